"""(under construction: see the issues)"""

__all__: list[str] = []
