"""The upper layers on CUDA, with the CPU as oracle: models, the Trainer and the CLI, snapshots
resumed across devices, every sparse optimizer on dynamic tables, tiered tables refused, serving.

Every test computes the CPU result itself and compares the CUDA result with it (moved to the CPU
first), within what a GPU's float32 reduction order allows (~1e-4 relative; AUC / log loss 2e-3).

The whole module is skipped without CUDA.  ``HUGEEMBED_TEST_CUDA_AS=cpu`` runs every test with
"cpu" in place of "cuda" (cpu against cpu), which checks the tests' own logic on a machine without
a GPU::

    HUGEEMBED_TEST_CUDA_AS=cpu python -m pytest -q tests/unit/test_cuda_end_to_end.py

(any device string works, e.g. ``HUGEEMBED_TEST_CUDA_AS=cuda:1``).

The same seed gives the same model on every device: make_model draws the dense weights on the
CPU and moves them, and table rows are a pure function of (seed, id).  Dropout masks come from
the device's own generator, so the DeepFM / Wide&Deep comparisons turn dropout off.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from hugeembed import checkpoint as ckpt
from hugeembed.cli import main
from hugeembed.errors import ConfigError
from hugeembed.features import SparseFeatures
from hugeembed.models import MODEL_NAMES, make_model
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.optim import Adagrad, make_optimizer
from hugeembed.optim._registry import NAMES as SPARSE_OPTIMIZER_NAMES
from hugeembed.training import TrainConfig, Trainer, build_model, evaluate_snapshot, load_snapshot_model, make_source

DEV = os.environ.get("HUGEEMBED_TEST_CUDA_AS", "cuda")

pytestmark = pytest.mark.skipif(torch.device(DEV).type == "cuda" and not torch.cuda.is_available(),
                                reason="needs CUDA (HUGEEMBED_TEST_CUDA_AS=cpu runs these tests cpu against cpu)")

RTOL, ATOL = 1e-4, 1e-5  # float32 sums in another order (GPU atomics, other kernels)
# Trainer runs (Adam on the dense layers and the tables, a dozen steps): Adam divides by
# sqrt(v), so a gradient at the rounding level moves a weight by up to lr either way.  Seen on
# an H200 after 12 steps: 10 of 6656 dense weights 4e-4 apart (one 2.4e-3), losses 1.5e-3
# relative, AUC on the small eval set 2.3e-3 apart.
METRIC_ATOL = 5e-3  # AUC / log loss of two runs that differ only by float rounding
RUN_RTOL, RUN_ATOL = 1e-2, 5e-3

FEATURES = ("a", "b", "c")
NUM_DENSE = 4
MODEL_OPTIONS = {
    "dlrm": dict(bottom_mlp=(8,), top_mlp=(8,)),
    "deepfm": dict(deep=(8,), dropout=0.0),  # dropout draws from the device's RNG: off
    "widedeep": dict(deep=(8,), dropout=0.0),
    "dcn": dict(deep=(8,), dropout=0.0, num_cross=2),
}
# a short training run: 12 steps of 128 rows on a small synthetic vocabulary, 1024 held-out rows
RUN = dict(model="dlrm", steps=12, batch_size=128, eval_rows=1024, eval_every=0, synthetic_max_cardinality=2000,
           embedding_dim=4, log_every=1)


# -- helpers -------------------------------------------------------------------------------


def cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu")


ID_RANGE = {"a": 12, "b": 12, "c": 120}


def batch(step: int, B: int = 16, device: str = "cpu"):
    """(dense [B, 4], sparse, labels [B]) of one step: mostly 1-2 ids per bag, one empty bag.  Few
    distinct ids in a and b, so that ids recur over the steps (optimizer state); many in c, so that
    some stay below the admission threshold (pending ids, the shared row of rare ids)."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = {}
    for f in FEATURES:
        lens = torch.randint(1, 3, (B,), generator=g).tolist()
        if f == FEATURES[0]:
            lens[0] = 0  # an empty bag pools to zeros
        ids[f] = [torch.randint(0, ID_RANGE[f], (k,), generator=g).tolist() for k in lens]
    dense = torch.rand(B, NUM_DENSE, generator=g)
    labels = (torch.rand(B, generator=g) < 0.4).float()
    return dense.to(device), SparseFeatures.from_lists(ids, device=device), labels.to(device)


def assert_dense_equal(a_params, b_params) -> None:
    """Bit-equal dense weights: the same seed builds the same model on every device."""
    a_params, b_params = list(a_params), list(b_params)
    assert [p.shape for p in a_params] == [p.shape for p in b_params]
    for i, (a, b) in enumerate(zip(a_params, b_params)):
        assert torch.equal(cpu(a), cpu(b)), f"dense param {i} differs at the start"


def assert_dense_close(a_params, b_params, rtol: float = RTOL, atol: float = ATOL) -> None:
    a_params, b_params = list(a_params), list(b_params)
    assert len(a_params) == len(b_params)
    for i, (a, b) in enumerate(zip(a_params, b_params)):
        torch.testing.assert_close(cpu(a), cpu(b), rtol=rtol, atol=atol, msg=lambda m: f"dense param {i}: {m}")


def assert_run_dense_close(a_params, b_params, cfg: TrainConfig) -> None:
    """Dense weights of two Trainer runs that differ only by float rounding: Adam moves a weight by
    at most about lr a step whatever its gradient, so a weight whose second moment is tiny can
    turn a rounding-level gradient into up to lr a step of difference (seen on an H200: 15-28 of
    262 k weights up to 7.8e-3 apart after 12 steps at lr 1e-3).  So: no weight further apart
    than steps * lr, and at most 0.5% of them beyond the run tolerances."""
    a_params, b_params = list(a_params), list(b_params)
    assert len(a_params) == len(b_params)
    bound = cfg.steps * cfg.dense_lr
    for i, (a, b) in enumerate(zip(a_params, b_params)):
        a, b = cpu(a).detach(), cpu(b).detach()
        diff = (a - b).abs()
        assert float(diff.max()) <= bound, f"dense param {i}: {float(diff.max())} apart (bound {bound})"
        off = (diff > RUN_ATOL + RUN_RTOL * b.abs()).sum().item()
        assert off <= 0.005 * a.numel(), f"dense param {i}: {off} of {a.numel()} weights beyond the run tolerances"


def exports(collection) -> dict:
    """Every table's contents on the CPU: {table: StoreExport} (keys ascending)."""
    return {cfg.name: store.export() for cfg, store in collection.stores()}


def assert_tables_close(a_collection, b_collection, rtol: float = RTOL, atol: float = ATOL) -> None:
    """Same keys, counts, steps and pending ids; rows (weights and optimizer state) close."""
    ea, eb = exports(a_collection), exports(b_collection)
    assert ea.keys() == eb.keys()
    for name in ea:
        a, b = ea[name], eb[name]
        for field in ("keys", "counts", "last_step", "pending_keys", "pending_counts", "pending_last_step"):
            assert torch.equal(cpu(getattr(a, field)), cpu(getattr(b, field))), (name, field)
        torch.testing.assert_close(cpu(a.rows), cpu(b.rows), rtol=rtol, atol=atol,
                                   msg=lambda m: f"table {name!r} rows: {m}")
    sa, sb = a_collection.state_dict(), b_collection.state_dict()  # the state_dict carries the same
    assert sa.keys() == sb.keys()
    assert int(sa["step"]) == int(sb["step"])


def step_model(model, dense_opt, dense, sparse, labels) -> float:
    loss = F.binary_cross_entropy_with_logits(model(dense, sparse), labels)
    dense_opt.zero_grad()
    loss.backward()  # the tables are updated in here
    dense_opt.step()
    return loss.item()


def build(name: str, device: str, seed: int = 3):
    model, dense = make_model(name, embedding_dim=4, sparse_optimizer=Adagrad(lr=0.05), device=device, seed=seed,
                              features=FEATURES, num_dense=NUM_DENSE, **MODEL_OPTIONS[name])
    return model, dense


def trainer(cfg: TrainConfig) -> Trainer:
    """A Trainer; on the device its dense weights start exactly as the CPU build's."""
    t = Trainer(cfg)
    if t.device.type != "cpu":
        ref, _ = build_model(cfg.replace(device="cpu"), torch.device("cpu"))
        assert_dense_equal(t.model.dense_parameters(), ref.dense_parameters())
    return t


def assert_runs_close(sa: dict, sb: dict) -> None:
    assert sa["steps"] == sb["steps"]
    for key in ("auc", "logloss", "ctr", "pctr"):
        assert abs(sa[key] - sb[key]) <= METRIC_ATOL, (key, sa[key], sb[key])
    assert sa["count"] == sb["count"]
    la, lb = sa["history"]["loss"], sb["history"]["loss"]
    assert len(la) == len(lb)
    torch.testing.assert_close(torch.tensor(la, dtype=torch.float64), torch.tensor(lb, dtype=torch.float64),
                               rtol=RUN_RTOL, atol=RUN_ATOL)


# -- 0. device names -------------------------------------------------------------------------------


def test_bare_and_indexed_device_names_are_one_device():
    """torch.device("cuda") != torch.device("cuda:0"), yet a tensor put on "cuda" lives on cuda:0
    (the current device): a collection built on either name takes a batch moved to either name,
    trains, and reports what the CPU does.  (What TrainConfig(device="auto" / "cuda") and
    ``--device cuda`` hand down is the bare name.)"""
    kind = torch.device(DEV).type
    names = [kind] + ([f"cuda:{torch.cuda.current_device()}"] if kind == "cuda" else [])
    ref = collection("sgd", "cpu")
    _, s, _ = batch(0)
    want = ref(s)
    (want["a"] ** 2).sum().backward()
    for built in names:
        for moved in names:
            ec = collection("sgd", built)
            out = ec(s.to(moved))
            (out["a"] ** 2).sum().backward()
            torch.testing.assert_close(cpu(out["a"]), cpu(want["a"]), rtol=RTOL, atol=ATOL)
            assert_tables_close(ec, ref)


# -- 1. models -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_trains_on_device_as_on_cpu(name):
    """make_model on both devices (the same seed: the same dense start), 6 steps of different batches: per-step
    losses, eval logits, final dense weights and every table (rows, optimizer state, counts,
    pending ids of the admission threshold, the shared row of rare ids) agree."""
    cpu_model, cpu_dense = build(name, "cpu")
    dev_model, dev_dense = build(name, DEV)
    assert all(p.device.type == torch.device(DEV).type for p in dev_model.parameters())
    assert_dense_equal(dev_dense, cpu_dense)
    cpu_opt, dev_opt = torch.optim.Adam(cpu_dense, lr=0.01), torch.optim.Adam(dev_dense, lr=0.01)
    for step in range(6):
        d, s, y = batch(step)
        lc = step_model(cpu_model, cpu_opt, d, s, y)
        ld = step_model(dev_model, dev_opt, d.to(DEV), s.to(DEV), y.to(DEV))
        assert ld == pytest.approx(lc, rel=RTOL, abs=ATOL), (step, lc, ld)
    assert_dense_close(dev_dense, cpu_dense)
    assert_tables_close(dev_model.embeddings, cpu_model.embeddings)
    assert dev_model.embeddings.num_rows() == cpu_model.embeddings.num_rows()
    cpu_model.eval()
    dev_model.eval()
    d, s, _ = batch(99)  # ids seen and unseen: unknown ids read the shared row
    with torch.no_grad():
        torch.testing.assert_close(cpu(dev_model(d.to(DEV), s.to(DEV))), cpu_model(d, s), rtol=RTOL, atol=ATOL)


def test_same_seed_same_tables_on_both_devices():
    """Table rows are a pure function of (seed, id): the first lookup agrees without any copying."""
    cpu_model, _ = build("dlrm", "cpu", seed=5)
    dev_model, _ = build("dlrm", DEV, seed=5)
    _, s, _ = batch(0)
    for m in (cpu_model, dev_model):
        m.train()
    out_c = cpu_model.embeddings(s)
    out_d = dev_model.embeddings(s.to(DEV))
    for f in FEATURES:
        torch.testing.assert_close(cpu(out_d[f]), cpu(out_c[f]), rtol=RTOL, atol=ATOL)


def test_model_moved_to_device_midway_continues_as_on_cpu():
    """A model trained 3 steps on the CPU, moved with .to(device) (tables and all), trained 3 more:
    as 6 steps on the CPU."""
    ref, ref_dense = build("dlrm", "cpu")
    moved, moved_dense = build("dlrm", "cpu")
    ref_opt, moved_opt = torch.optim.Adam(ref_dense, lr=0.01), torch.optim.Adam(moved_dense, lr=0.01)
    for step in range(3):
        d, s, y = batch(step)
        assert step_model(ref, ref_opt, d, s, y) == step_model(moved, moved_opt, d, s, y)
    moved.to(DEV)  # the Adam state moves with load_state_dict only: a fresh Adam on both sides
    assert moved.embeddings.device.type == torch.device(DEV).type
    assert all(store.device.type == torch.device(DEV).type for _, store in moved.embeddings.stores())
    ref_opt, moved_opt = torch.optim.Adam(ref_dense, lr=0.01), torch.optim.Adam(moved.dense_parameters(), lr=0.01)
    for step in range(3, 6):
        d, s, y = batch(step)
        lc = step_model(ref, ref_opt, d, s, y)
        ld = step_model(moved, moved_opt, d.to(DEV), s.to(DEV), y.to(DEV))
        assert ld == pytest.approx(lc, rel=RTOL, abs=ATOL), (step, lc, ld)
    assert_dense_close(moved.dense_parameters(), ref_dense)
    assert_tables_close(moved.embeddings, ref.embeddings)


# -- 4. dynamic tables, every sparse optimizer --------------------------------------------------


def collection(optimizer: str, device: str) -> EmbeddingCollection:
    opts = dict(lr=0.05)
    if optimizer == "ftrl":
        opts = dict(lr=0.1)
    tables = [TableConfig("dyn", 4, features=("a", "b"), combiner="sum"),  # dynamic, read by two features
              TableConfig("rare", 4, features=("c",), combiner="mean", admit_min_count=2, shared_row=True),
              TableConfig("static", 2, num_rows=ID_RANGE["c"], features=("c",), combiner="sqrtn")]
    return EmbeddingCollection(tables, optimizer=make_optimizer(optimizer, **opts), device=device, seed=7)


@pytest.mark.parametrize("optimizer", list(SPARSE_OPTIMIZER_NAMES))
def test_collection_with_each_sparse_optimizer_as_on_cpu(optimizer):
    """5 training steps of a collection (dynamic tables, one with an admission threshold and a
    shared row, a static table): every step's outputs, the tables after them, and an eval lookup
    (global Adam: read through caught-up copies) agree with the CPU's."""
    ec_c, ec_d = collection(optimizer, "cpu"), collection(optimizer, DEV)
    target = torch.linspace(-1, 1, 4)
    for step in range(5):
        _, s, _ = batch(step)
        outs = []
        for ec, sf in ((ec_c, s), (ec_d, s.to(DEV))):
            out = ec(sf)
            t = target.to(ec.device)
            loss = ((out["a"] - t) ** 2).sum() + (out["b"] * t).sum() + ((out["c@rare"] + 0.5) ** 2).sum() \
                + (out["c@static"] ** 2).sum()
            loss.backward()
            ec.optimizer.step()
            outs.append({k: cpu(out[k]) for k in ("a", "b", "c@rare", "c@static")})
        for k in outs[0]:
            torch.testing.assert_close(outs[1][k], outs[0][k], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{optimizer} step {step} output {k}: {m}")
    assert ec_d.step == ec_c.step == 5
    assert_tables_close(ec_d, ec_c)
    ec_c.eval()
    ec_d.eval()
    _, s, _ = batch(50)
    with torch.no_grad():
        oc, od = ec_c(s), ec_d(s.to(DEV))
        for k in ("a", "b", "c@rare", "c@static"):
            torch.testing.assert_close(cpu(od[k]), cpu(oc[k]), rtol=RTOL, atol=ATOL)
    # catch_up_rows brings global Adam's rows current (a no-op for the others): the same on both
    ec_c.catch_up_rows()
    ec_d.catch_up_rows()
    assert_tables_close(ec_d, ec_c)


def test_collection_state_dict_moves_between_devices():
    """A collection's state_dict saved on one device loads into a collection on the other and
    training continues there as it would have."""
    for src, dst in ((DEV, "cpu"), ("cpu", DEV)):
        a, ref = collection("adam_per_row", src), collection("adam_per_row", dst)
        for step in range(3):
            for ec in (a, ref):
                _, s, _ = batch(step)
                out = ec(s.to(ec.device))
                sum((out[k] ** 2).sum() for k in ("a", "b", "c@rare")).backward()
        b = collection("adam_per_row", dst)
        b.load_state_dict(a.state_dict())
        assert_tables_close(b, ref)
        for step in range(3, 5):
            for ec in (b, ref):
                _, s, _ = batch(step)
                out = ec(s.to(ec.device))
                sum((out[k] ** 2).sum() for k in ("a", "b", "c@rare")).backward()
        assert_tables_close(b, ref)


# -- 2. the Trainer and the CLI -------------------------------------------------------------------


def test_trainer_run_on_device_matches_cpu(tmp_path):
    """The same 12-step run on the CPU and on the device: losses step by step, final AUC / log loss,
    tables and dense weights agree; both write their final snapshot."""
    runs = {}
    for dev in ("cpu", DEV):
        cfg = TrainConfig(device=dev, checkpoint_dir=str(tmp_path / dev.replace(":", "_")), **RUN)
        t = trainer(cfg)
        s = t.fit()
        assert s["steps"] == 12 and s["device"] == str(t.device)
        snap = ckpt.latest(cfg.checkpoint_dir)
        assert snap is not None and snap.name == "step-000000012"
        runs[dev] = (t, s)
    (tc, sc), (td, sd) = runs["cpu"], runs[DEV]
    assert td.device.type == torch.device(DEV).type
    assert_runs_close(sd, sc)
    assert_run_dense_close(td.model.dense_parameters(), tc.model.dense_parameters(), td.cfg)
    assert_tables_close(td.collection, tc.collection, RUN_RTOL, RUN_ATOL)
    # the device run's snapshot, scored again on the CPU and on the device: its final evaluation
    for where in ("cpu", DEV):
        m = evaluate_snapshot(tmp_path / DEV.replace(":", "_"), device=where)
        assert m["step"] == 12
        for key in ("auc", "logloss"):
            assert abs(m[key] - sd[key]) <= METRIC_ATOL, (where, key, m[key], sd[key])


@pytest.mark.parametrize("model", ["deepfm", "widedeep", "dcn"])
def test_trainer_other_models_on_device(model):
    """Each other model runs a short training job on the device as on the CPU (no dropout: its
    masks come from the device's RNG)."""
    summaries = []
    for dev in ("cpu", DEV):
        cfg = TrainConfig(**{**RUN, "model": model, "steps": 6, "device": dev})
        t = trainer(cfg)
        if model != "dcn":  # DeepFM / Wide&Deep default to dropout 0.5 (DCN-v2: 0): the masks differ by device
            for m in t.model.modules():
                if isinstance(m, torch.nn.Dropout):
                    m.p = 0.0
        summaries.append(t.fit())
    assert_runs_close(summaries[1], summaries[0])


def test_cli_train_on_device_then_eval_and_export(tmp_path, capsys):
    """`hugeembed train --device DEV` finishes, reports the device, writes its snapshot; `hugeembed eval`
    on the CPU and on the device reproduces its final AUC / log loss; the export of that snapshot
    (served on the CPU) predicts what the model loaded on the device predicts."""
    ck = tmp_path / "ck"
    rc = main(["train", "--steps", "6", "--eval-every", "0", "--device", DEV, "--batch-size", "64", "--eval-rows",
               "256", "--synthetic-rows", "20000", "--embedding-dim", "4", "--checkpoint-dir", str(ck),
               "--summary-json", str(tmp_path / "s.json"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 0, err
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["steps"] == 6 and s["device"].startswith(torch.device(DEV).type)
    assert ckpt.latest(ck) is not None and ckpt.latest(ck).name == "step-000000006"
    for where in ("cpu", DEV):
        assert main(["eval", "--checkpoint", str(ck), "--device", where, "--summary-json",
                     str(tmp_path / f"e_{where.replace(':', '_')}.json")]) == 0, capsys.readouterr().err
        e = json.loads((tmp_path / f"e_{where.replace(':', '_')}.json").read_text())
        for key in ("auc", "logloss"):
            assert abs(e[key] - s[key]) <= METRIC_ATOL, (where, key, e[key], s[key])

    # 6. serving: the export runs on the CPU (the snapshot loads there); the served model predicts
    # what the device model does
    from hugeembed.serving import ServingModel, export

    art = export(ck, tmp_path / "art", dtype="fp32")
    served = ServingModel.load(art)
    model, cfg, _ = load_snapshot_model(ck, device=DEV)
    assert next(model.parameters()).device.type == torch.device(DEV).type
    batches = list(make_source(cfg).eval_batches())[:2]
    with torch.no_grad():
        for b in batches:
            want = cpu(torch.sigmoid(model(b.dense.to(DEV), b.sparse.to(DEV))))
            torch.testing.assert_close(served.predict(b.dense, b.sparse), want, rtol=RTOL, atol=ATOL)


# -- 3. snapshots resumed across devices ----------------------------------------------------------


@pytest.mark.parametrize("first,then", [(DEV, "cpu"), ("cpu", DEV)], ids=["device-then-cpu", "cpu-then-device"])
def test_snapshot_resumes_on_the_other_device(tmp_path, first, then):
    """A run snapshotted at step 9 (inside the lr-decay phase, so the snapshot holds the running
    dense average too) on one device, resumed on the other: ends as the uninterrupted run on the
    resuming device (float rounding apart), tables, dense weights and metrics."""
    base = TrainConfig(**{**RUN, "lr_decay": 0.5})  # decay over steps 7-12: the dense average starts at step 7
    whole_t = trainer(base.replace(device=then))
    whole = whole_t.fit()

    ck = tmp_path / "ck"
    trainer(base.replace(device=first, checkpoint_dir=str(ck), checkpoint_every=3, keep_checkpoints=10)).fit()
    shutil.rmtree(ck / "step-000000012")  # as if the run had stopped after its step-9 snapshot
    (ck / "LATEST").write_text("step-000000009\n")  # (which LATEST then named)
    assert ckpt.latest(ck).name == "step-000000009"
    resumed_t = Trainer(base.replace(device=then, checkpoint_dir=str(ck), resume=True))
    resumed = resumed_t.fit()

    assert resumed["steps"] == 12 and resumed["device"] == str(resumed_t.device)
    assert_runs_close_final(resumed, whole)
    assert_run_dense_close(resumed_t.model.dense_parameters(), whole_t.model.dense_parameters(), whole_t.cfg)
    assert_tables_close(resumed_t.collection, whole_t.collection, RUN_RTOL, RUN_ATOL)
    assert ckpt.latest(ck).name == "step-000000012"


def assert_runs_close_final(resumed: dict, whole: dict) -> None:
    """A resumed run's summary against the uninterrupted run's: the final metrics, and the loss
    points recorded after the resume (the resumed run's history continues the snapshot's)."""
    assert resumed["steps"] == whole["steps"]
    for key in ("auc", "logloss", "ctr", "pctr"):
        assert abs(resumed[key] - whole[key]) <= METRIC_ATOL, (key, resumed[key], whole[key])
    assert resumed["history"]["step"] == whole["history"]["step"]
    torch.testing.assert_close(torch.tensor(resumed["history"]["loss"], dtype=torch.float64),
                               torch.tensor(whole["history"]["loss"], dtype=torch.float64), rtol=RUN_RTOL,
                               atol=RUN_ATOL)


# -- 5. tiered tables stay on the CPU -------------------------------------------------------------


def test_tiered_table_on_a_device_collection_is_refused_clearly(tmp_path):
    tables = [TableConfig("t", 4, storage_dir=str(tmp_path / "tier"), memory_budget=1 << 16)]
    if torch.device(DEV).type == "cpu":  # (cpu stand-in: the table is allowed there)
        EmbeddingCollection(tables, optimizer=Adagrad(lr=0.1), device=DEV)
        pytest.skip("tiered tables are allowed on the CPU; the refusal is checked on CUDA")
    with pytest.raises(ConfigError, match=r"table 't': a disk-tiered table \(storage_dir\) lives on the CPU, "
                                          r"the collection is on cuda"):
        EmbeddingCollection(tables, optimizer=Adagrad(lr=0.1), device=DEV)


def test_cli_tiered_run_on_a_device_is_a_one_line_error(tmp_path, capsys):
    if torch.device(DEV).type == "cpu":
        pytest.skip("tiered tables are allowed on the CPU; the refusal is checked on CUDA")
    rc = main(["train", "--steps", "2", "--device", DEV, "--batch-size", "64", "--eval-rows", "128",
               "--synthetic-rows", "20000", "--embedding-dim", "4", "--memory-budget", "10000000", "--storage-dir",
               str(tmp_path / "tier"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "disk-tiered table" in err and "lives on the CPU" in err, err
