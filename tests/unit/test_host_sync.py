"""No host-device synchronisation between report steps: a step of every built-in task, as the loop runs it
(behemoth.worker.loop.step: the update, the loss and sample count, the unreadable samples; then the weight
average's update, the loop's callback after it), asks the device for nothing. A GPU step that waits for the
device to hand the host a number (`.item()`, `.tolist()`, a boolean mask, a blocking copy) drains the queue of kernels the host had run ahead with: at a 20 ms step, a few of
those cost the percent that separates a platform from a plain script.

This machine has no GPU, so the syncs are caught where they are asked for, not where they would wait: a
TorchDispatchMode sees the aten operations whose result the host must read (`_local_scalar_dense` behind
`.item()`, `float()`, `bool()`; `nonzero` behind boolean indexing and masks; `unique`, `equal`, ...), and a
TorchFunctionMode the Python-level copies to the host (`.tolist()`, `.cpu()`, `.numpy()`) and tensors built from
Python values straight onto the device (`torch.tensor(x, device=...)`: a blocking copy on a GPU). On the CPU
every tensor lives on the host, so two things cannot be told apart here and are settled by rule: AdamW's step
counters are host tensors by torch's design (their `.item()` waits for nothing: exempt), and any
`torch.tensor(..., device=...)` counts. The GPU tier runs the same steps under
`torch.cuda.set_sync_debug_mode("error")`, which sees the real ones.
"""

from __future__ import annotations

import traceback

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from behemoth import hosts
from behemoth.storage.checkpoint import TrainState
from behemoth.job import config_from_dict
from behemoth.metrics import PhaseClock, Window
from conftest import job_dict, lm_job_dict

aten = torch.ops.aten
# aten operations whose result the host reads (a device-to-host copy and a wait on a GPU)
_READS_DEVICE = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
                 aten.equal.default, aten.is_nonzero.default, aten._unique2.default, aten.unique_dim.default,
                 aten.unique_consecutive.default, aten.repeat_interleave.Tensor, aten.bincount.default}
_BOOL_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_TO_HOST = {torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy}


def _where() -> str:
    """The innermost caller outside torch and the watch's modes: who asked."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if "/torch/" not in frame.filename and frame.name not in ("__torch_function__", "__torch_dispatch__"):
            return f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno} {frame.line}"
    return "?"


class HostSyncs:
    """Records every operation that would make the host wait for the device while the block runs."""

    def __init__(self, host_counters=()):
        self.found: list[str] = []
        self._exempt = {t.untyped_storage().data_ptr() for t in host_counters}
        outer = self

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func in _READS_DEVICE:
                    first = args[0] if args else None
                    if not (isinstance(first, torch.Tensor) and first.untyped_storage().data_ptr() in outer._exempt):
                        outer.found.append(f"{func} at {_where()}")
                elif func in _BOOL_INDEXED:
                    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
                    if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
                        outer.found.append(f"{func} with a boolean index at {_where()}")
                return func(*args, **kwargs)

        class Function(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func in _TO_HOST:
                    outer.found.append(f"Tensor.{func.__name__}() at {_where()}")
                elif func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
                    outer.found.append(f"torch.{func.__name__}(..., device=...) at {_where()}")
                return func(*args, **kwargs)

        self._modes = [Function(), Dispatch()]

    def __enter__(self):
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


class _Host(hosts.WorkerHost):
    """One worker, no Ray: what the loop's model building asks of its host."""

    def __init__(self, device=torch.device("cpu")):
        self._device = device

    @property
    def device(self):
        return self._device

    def prepare_model(self, model, wrap_ddp):
        return model.to(self._device)


def _image_task(tmp_path, image_root, recipe: bool = False):
    """The image task's steps; `recipe`: with label smoothing, mixup and cutmix, non-finite steps skipped (the
    fused optimizer reading its flag on the device) and a weight average, SGD as before."""
    from behemoth.data.image.images import build_index
    from behemoth.tasks.image import ImageClassification

    data = {"cache": "none", **({"label_smoothing": 0.1, "mixup_alpha": 0.2, "cutmix_alpha": 1.0} if recipe else {})}
    train = {"grad_clip": 1.0, **({"nonfinite": "skip", "ema_decay": 0.99} if recipe else {})}
    cfg = config_from_dict(job_dict(image_root, tmp_path, train=train,
                                    scaling={"num_workers": 1, "torch_threads": 1}, data=data))
    task = ImageClassification(cfg, build_index(cfg.data))
    size, gen = cfg.data.image_size, torch.Generator().manual_seed(0)

    def batches(step):  # what the pipeline hands a step: uint8 NHWC, labels, one undecodable image
        return [{"image": torch.randint(0, 256, (8, size, size, 3), dtype=torch.uint8, generator=gen),
                 "label": torch.randint(0, len(task.index.classes), (8,), generator=gen),
                 "valid": torch.arange(8) != (step + i) % 8,
                 "sample_id": torch.arange(8) + 16 * step + 8 * i} for i in range(2)]
    return cfg, task, batches


def _lm_task(tmp_path, text_corpus, documents: bool = False):
    from behemoth.data.text.text_packing import TokenIndex
    from behemoth.data.token_store import TokenBlocks, block_records
    from behemoth.tasks.causal_lm import CausalLM

    cfg = config_from_dict(lm_job_dict(text_corpus, tmp_path, train={"grad_clip": 1.0, "precision": "bf16"},
                                       scaling={"num_workers": 1}, data={"document_mask": documents}))
    rng = np.random.default_rng(0)
    records = np.zeros(64, dtype=block_records(cfg.data.seq_len, np.uint16))
    records["id"], records["tokens"] = np.arange(64), rng.integers(0, 400, (64, cfg.data.seq_len))
    task = CausalLM(cfg, TokenIndex(TokenBlocks(records), TokenBlocks(records[:8]), vocab_size=400, eos_id=0,
                                    bos_id=None))
    return cfg, task, lambda step: list(task.train_batches(list(range(16 * step, 16 * step + 16)), 0, 8))


def _classifier_task(tmp_path, text_corpus):
    from behemoth.data.text.labelled_text import TokenisedRows, _tokenise_batch, load_classification_tokenizer
    from behemoth.tasks.text_classification import TextClassification

    texts = [f"story {i} about a {'happy' if i % 2 else 'sad'} dog" for i in range(64)]
    (tmp_path / "t.jsonl").write_text("")
    job = {"data": {"kind": "text_classification", "train_files": [str(tmp_path / "t.jsonl")],
                    "val_files": [str(tmp_path / "t.jsonl")], "tokenizer": str(text_corpus / "tokenizer"),
                    "max_length": 16},
           "model": {"name": "sequence_classifier", "hf_config": {
               "model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
               "num_attention_heads": 2, "max_position_embeddings": 16}},
           "train": {"global_batch_size": 16, "grad_clip": 1.0}, "scaling": {"num_workers": 1},
           "checkpoint": {"storage_path": str(tmp_path)}}
    cfg = config_from_dict(job)
    tok = load_classification_tokenizer(cfg.data.tokenizer)
    arrays = _tokenise_batch({"text": np.asarray(texts)}, cfg.data.tokenizer, 16)
    ids, mask = arrays["input_ids"], arrays["attention_mask"]
    labels = np.arange(64, dtype=np.int64) % 2
    rows = TokenisedRows({"train": ids, "val": ids}, {"train": mask, "val": mask}, {"train": labels, "val": labels},
                         ["sad", "happy"], {"train": [("t", 64)], "val": [("t", 64)]}, tok.pad_token_id, len(tok))
    task = TextClassification(cfg, rows)
    return cfg, task, lambda step: list(task.train_batches(list(range(16 * step, 16 * step + 16)), 0, 8))


@pytest.fixture(params=["image", "image_recipe", "causal_lm", "causal_lm_documents", "text_classification"])
def built_task(request, tmp_path):
    if request.param.startswith("image"):
        return _image_task(tmp_path, request.getfixturevalue("image_root"), recipe=request.param == "image_recipe")
    if request.param == "causal_lm_documents":  # data.document_mask: a 4-D mask and position ids per batch
        return _lm_task(tmp_path, request.getfixturevalue("text_corpus"), documents=True)
    maker = _lm_task if request.param == "causal_lm" else _classifier_task
    return maker(tmp_path, request.getfixturevalue("text_corpus"))


def _steps_under_watch(cfg, task, batches, steps: int = 3, device=torch.device("cpu"),
                       watch=None) -> tuple[list[str], Window]:
    """The loop's model building, then `steps` steps of two micro-batches each (the first unwatched: AdamW
    makes its state there), as the loop runs them; what the watched steps asked the device (`watch`: a
    context manager with `found`, HostSyncs by default)."""
    from behemoth.worker.step_callbacks import Callbacks
    from behemoth.worker.loop import _build_run, step
    from behemoth.worker.step_context import StepContext

    with hosts.hosted(_Host(device)):
        run, speed, micro_batch, accum, _ = _build_run(cfg, task, PhaseClock(), 0, 1, device, total_steps=100)
        ctx = StepContext(cfg, task, run, device, 0, 1, PhaseClock(), speed, None, micro_batch, accum, 100, 100)
        after_update = Callbacks([run.ema]).after_update  # the step's own callback: the weight average's update
        state, window = TrainState(world_size=1), Window()
        loss_sum, n_valid = step(ctx, state, _on(batches(0), device), window, 0.0)
        after_update(ctx, state, batches(0), loss_sum, n_valid)
        counters = [s["step"] for s in run.optimizer.state.values() if isinstance(s.get("step"), torch.Tensor)]
        ready = [_on(batches(i), device) for i in range(1, steps)]  # (copies outside the watch: the feed's)
        with watch or HostSyncs(host_counters=counters) as watching:
            for i in range(1, steps):
                state.step = i
                loss_sum, n_valid = step(ctx, state, ready[i - 1], window, 0.0)
                after_update(ctx, state, ready[i - 1], loss_sum, n_valid)
    return watching.found, window


def _on(micro_batches: list[dict], device) -> list[dict]:
    """A step's batches on the device, as the feed hands them over (pinned, non-blocking)."""
    if device.type == "cpu":
        return micro_batches
    return [{k: v.pin_memory().to(device, non_blocking=True) if v.device.type == "cpu" and k != "sample_id" else v
             for k, v in b.items()} for b in micro_batches]


# The one sync left, by name: a padded batch's attention mask goes through transformers' create_causal_mask,
# which reads whether the batch has padding at all (to drop the mask where it has none): once per forward.
# Building the 4D mask here instead would change the kernels' input for every model family. Matched by the module,
# not a line number: the line moves between transformers releases (292 in 5.24; the GPU machine's image has 5.17).
_KNOWN = {"text_classification": "transformers/masking_utils.py:"}


def test_a_step_asks_the_device_nothing(built_task):
    cfg, task, batches = built_task
    found, window = _steps_under_watch(cfg, task, batches)
    known = _KNOWN.get(cfg.data.kind)
    if known:  # exactly once per micro-batch's forward (2 watched steps x 2 micro-batches), nothing else
        assert sum(known in line for line in found) == 4, found
        found = [line for line in found if known not in line]
    assert not found, "host syncs in a training step:\n  " + "\n  ".join(found)
    assert window.steps == 3
    # ... and the report reads what the steps kept on the device
    images = cfg.data.kind == "image_folder"
    # an undecodable image per micro-batch (mixed: its partner, whose image it would share, too)
    dropped = (4 if cfg.data.mixup_alpha else 2) if images else 0
    if getattr(cfg.data, "document_mask", False):  # the loss is per predicted token: not a document's first
        with hosts.hosted(_Host(torch.device("cpu"))):
            predicted = sum(float(task.loss_items(b)) for s in range(3) for b in batches(s))
        assert float(window.loss_count) == predicted
        assert float(window.loss_count) < 3 * 16 * (cfg.data.seq_len - 1)
    else:
        assert float(window.loss_count) == 3 * (16 - dropped)
    if images:
        assert window.bad_sample_ids() == {16 * s + 8 * i + (s + i) % 8 for s in range(3) for i in range(2)}


class _CudaSyncWarnings:
    """torch.cuda.set_sync_debug_mode("warn") while the block runs: every call that synchronises the host with
    the GPU warns; `found` lists them."""

    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings(record=True)
        self._seen = self._catch.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)
        self.found = [f"{w.message} at {w.filename}:{w.lineno}" for w in self._seen
                      if "synchroniz" in str(w.message)]


@pytest.mark.gpu
def test_a_gpu_step_never_waits_for_the_gpu(built_task):
    """The same steps on a GPU, under CUDA's own sync detection (set_sync_debug_mode): none, but the
    classifier's padded-mask check inside transformers, once per forward."""
    cfg, task, batches = built_task
    device = torch.device("cuda", 0)
    found, _ = _steps_under_watch(cfg, task, batches, device=device, watch=_CudaSyncWarnings())
    if cfg.data.kind == "text_classification":
        assert len(found) <= 4, found
        found = []
    assert not found, "GPU syncs in a training step:\n  " + "\n  ".join(found)


def test_the_watch_sees_the_syncs_it_is_for(tmp_path, image_root):
    """The detector itself: a task that reads its sample count with .item() and its bad samples with a boolean
    mask and .tolist() is caught, every one, each naming its line."""
    cfg, task, batches = _image_task(tmp_path, image_root)

    class Syncing(type(task)):
        def loss(self, model, batch):
            loss, n = super().loss(model, batch)
            return loss, torch.tensor(float(n.item()), device=n.device)

        def bad_samples(self, batch):
            bad = batch["sample_id"][~batch["valid"]].tolist()
            return torch.as_tensor(bad, device=batch["valid"].device) if bad else None

    task.__class__ = Syncing
    found, _ = _steps_under_watch(cfg, task, batches)
    text = "\n".join(found)
    for what in ("_local_scalar_dense", "torch.tensor(..., device=...)", "boolean index", "Tensor.tolist()",
                 "torch.as_tensor(..., device=...)"):
        assert what in text, text
    assert all("test_host_sync.py" in line for line in found), text  # each names the task's line


def test_mask_free_causal_attention_computes_what_transformers_does():
    """The causal LM trains with SDPA told is_causal=True and no mask built (models/causal_lm.py): the loss and
    every gradient are those of transformers' own path, bit for bit; a sliding-window config keeps its mask."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from behemoth.models.causal_lm import train_on_causal_attention

    def config():  # one each: a model holds its config, and the attention implementation is set there
        return AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=100)

    ours, theirs = AutoModelForCausalLM.from_config(config()), AutoModelForCausalLM.from_config(config())
    theirs.load_state_dict(ours.state_dict())
    train_on_causal_attention(ours)
    assert ours.config._attn_implementation == "behemoth_causal_sdpa"
    assert theirs.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 100, (3, 24))
    losses = []
    for model in (ours, theirs):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours.parameters(), theirs.parameters()))

    windowed = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "mistral", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, sliding_window=8))
    assert train_on_causal_attention(windowed).config._attn_implementation == "sdpa"
