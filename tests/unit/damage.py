"""Shared by the tests that damage a JSON record (manifests, run records) one field at a time."""

from __future__ import annotations


def set_field(path, value):
    """A function that sets (or, with value=KeyError, deletes) the field at `path` of a nested dict."""
    def change(record):
        d = record
        for k in path[:-1]:
            d = d[k]
        if value is KeyError:
            del d[path[-1]]
        else:
            d[path[-1]] = value
        return record
    return change
