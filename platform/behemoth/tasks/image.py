"""Image classification: Ray Data decodes and augments the rank's samples; cross-entropy; top-1 accuracy.

The model: a registered name, `image_classifier` (any transformers AutoModelForImageClassification) or a
user's builder by import path (behemoth.models.registry). Registered and transformers models are called as
`model(pixel_values=...).logits`; a user's module as `model(images)`, returning the logits.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

# torch is imported where it is used: reading a job config loads its task's class, and `behemoth check`
# answers a bad config or data file without the ~1.5 s of importing torch (a crafted shard: 0.3 s in all)
if TYPE_CHECKING:
    import torch

from behemoth.storage import weights
from behemoth.storage.checkpoint import read_json
from behemoth.config import JobConfig
from behemoth.errors import BadSampleError, ConfigError
from behemoth.data.image import image_cache, image_cache_build
from behemoth.data.image.image_cache import decide_cache
from behemoth.data.image.image_batches import cached_batches, describe_samples, normalise, rank_batches
from behemoth.data.image.image_config import DEFAULT_MEAN, DEFAULT_STD, ImageData
from behemoth.data.image.images import ImageIndex, build_index
from behemoth.data.prefetch import prefetched
from behemoth.models import registry
from behemoth.models.image_classifier import pretrained_preprocessing
from behemoth import hosts
from behemoth.tasks.contract import Task, local_model


def build_image_model(cfg: JobConfig, classes: list[str]) -> torch.nn.Module:
    """The job's model for these classes; a transformers model also gets their names (id2label, label2id),
    which its exported config.json carries."""
    name = cfg.model.name
    if name == registry.IMAGE_CLASSIFIER:
        from behemoth.models.image_classifier import build_image_classifier

        model = build_image_classifier(local_model(cfg), num_classes=len(classes), image_size=cfg.data.image_size)
    else:
        model = registry.build_model(name, len(classes))
    if hasattr(getattr(model, "config", None), "id2label"):
        model.config.id2label = dict(enumerate(classes))
        model.config.label2id = {c: i for i, c in enumerate(classes)}
    return model


class ImageClassification(Task[ImageIndex, ImageIndex]):
    # --- driver side ------------------------------------------------------------------------------------
    data_config = ImageData
    best = ("val_accuracy", "max")
    reported = {"val_accuracy": "max", "val_loss": "min", "loss": "min"}  # (val_top5_accuracy: > 5 classes only)
    model_names = tuple(registry.MODELS)
    hf_models = {registry.IMAGE_CLASSIFIER: "vit"}  # any AutoModelForImageClassification
    bad_samples_are = "undecodable images"
    builder_keywords = "num_classes"

    completed_keys = ("mean", "std", "eval_crop_pct")

    @classmethod
    def complete(cls, cfg: JobConfig) -> None:
        """data.mean / data.std / data.eval_crop_pct left out: model.pretrained's (its image processor's: ImageNet's
        statistics and 0.875 for a ResNet, 0.5 for a ViT), else 0.5 / 0.25 / 1; written into the job, so that its
        job.yaml (and a resume's comparison with it) names them."""
        data, model = cfg.data, cfg.model
        if model.pretrained and not (data.mean and data.std and data.eval_crop_pct):
            found = pretrained_preprocessing(local_model(cfg, weights=False).pretrained, model.pretrained)
            if found.mean is None and not (data.mean and data.std):
                print(f"[behemoth] warning: model.pretrained {model.pretrained} has no image processor giving "
                      f"image_mean and image_std: data.mean / data.std default to {DEFAULT_MEAN} / {DEFAULT_STD}; "
                      f"set them to the statistics the model was trained with", file=sys.stderr, flush=True)
            data.mean, data.std = data.mean or found.mean or [], data.std or found.std or []
            data.eval_crop_pct = data.eval_crop_pct or found.crop_pct
        data.mean, data.std = list(data.mean or DEFAULT_MEAN), list(data.std or DEFAULT_STD)
        data.eval_crop_pct = data.eval_crop_pct or 1.0  # (a job.yaml names it: export never reads the model again)

    @classmethod
    def data_modules(cls, cfg: JobConfig, index: ImageIndex) -> tuple[str, ...]:
        """What its decode tasks import (on a local instance their processes start while Ray Train starts):
        nothing where every image is read from a decoded cache that is built already (no task will run)."""
        if index.cache and all(image_cache.check(Path(p.folder), p) is None for p in index.cache.values()):
            return ()
        # random_resized_crop resizes with torch (data/image/decode.py)
        return ("ray.data", "behemoth.data.image.image_batches",
                *(("torch",) if cfg.data.augment == "random_resized_crop" else ()))

    @classmethod
    def check(cls, cfg: JobConfig) -> ImageIndex:
        """The index of samples (files or parquet rows, labels), built and checked on the driver; a user's
        model builder is called once on torch's meta device (no memory) to check what it returns."""
        index = build_index(cfg.data)
        if registry.is_import_path(cfg.model.name):
            registry.check_user_model(cfg.model.name, num_classes=len(index.classes))
        elif cfg.model.name == registry.IMAGE_CLASSIFIER:
            from behemoth.models.image_classifier import check_image_classifier

            check_image_classifier(cfg.model, num_classes=len(index.classes), image_size=cfg.data.image_size)
        return index

    @classmethod
    def prepare(cls, cfg: JobConfig, index: ImageIndex) -> ImageIndex:
        """The workers decode their own samples, in Ray Data tasks: every epoch, or once per node into the
        decoded cache (the decision, made here, is the run's: one line says what and why)."""
        index.cache, line = decide_cache(cfg.data, index)
        print(f"[behemoth] data cache: {line}", flush=True)
        warning = index.cache and image_cache.network_warning(Path(index.cache["train"].folder).parent)
        if warning:
            print(f"[behemoth] warning: {warning}", flush=True)
        return index

    @classmethod
    def train_samples(cls, cfg: JobConfig, index: ImageIndex) -> int:
        return index.train.num_rows

    @classmethod
    def describe(cls, cfg: JobConfig, index: ImageIndex) -> str:
        return f"{index.train.num_rows} train / {index.val.num_rows} val samples, {len(index.classes)} classes"

    @classmethod
    def data_cpus(cls, cfg: JobConfig) -> float:
        return cfg.data.cpus_per_task  # decode tasks run beside the workers

    @staticmethod
    def summary_lines(m: dict) -> list[str]:
        out = []
        if "val_accuracy" in m:
            out.append(f"final val_acc:     {m['val_accuracy']:.4f} (val_loss {m['val_loss']:.4f}, "
                       f"{m['val_samples']} samples)")
        if m.get("bad_samples") or m.get("val_bad_samples"):
            out.append(f"dropped images:    {m.get('bad_samples', 0)} undecodable in train, "
                       f"{m.get('val_bad_samples', 0)} in val (data.max_bad_samples)")
        return out

    @staticmethod
    def progress_fields(m: dict) -> list[str]:
        return [f"val_loss {m['val_loss']:.4f}", f"val_acc {m['val_accuracy']:.4f}"] if "val_accuracy" in m else []

    @classmethod
    def model_from_checkpoint(cls, cfg: JobConfig, ckpt: str) -> torch.nn.Module:
        """Driver side (export): the model a checkpoint holds, built as the workers built it."""
        from behemoth.models.wrappers import in_model_dtype

        classes = read_json(ckpt, "classes.json")  # (checked against its manifest, as the weights are)
        model = in_model_dtype(build_image_model(cfg, classes), cfg.model.dtype)  # (as the workers trained it)
        weights.load_weights(model, weights.read_state_dict(ckpt), ckpt)
        # the registered RegNets train as plain torch modules with transformers' layout (models/regnet.py)
        return model.to_transformers(classes) if hasattr(model, "to_transformers") else model

    @classmethod
    def save_for_transformers(cls, cfg: JobConfig, out: Path) -> None:
        """An image processor config that repeats the validation preprocessing (behemoth.data.image.image_batches:
        decode_rgb, center_fit, then /255 and mean/std): RGB, shorter side resized to data.image_size /
        data.eval_crop_pct (bilinear, the longer side's size truncated as transformers does), centre crop of
        data.image_size. With transformers' PIL
        backend the pixels are behemoth's, bit for bit (tests/unit/test_export_parity.py). Its torchvision
        backend (the default where torchvision is installed) resizes to the same size and crops the same
        window, but torch's uint8 resize rounds some values one level off PIL's (and differently on CPUs with
        and without AVX2): logits within ~1e-3, not bit-exact."""
        size = cfg.data.image_size
        (out / "preprocessor_config.json").write_text(json.dumps({
            "image_processor_type": "BitImageProcessor",
            "do_convert_rgb": True,
            "do_resize": True, "size": {"shortest_edge": cfg.data.eval_fit()}, "resample": 2,  # PIL.Image.BILINEAR
            "do_center_crop": True, "crop_size": {"height": size, "width": size},
            "do_rescale": True, "rescale_factor": 1 / 255,
            "do_normalize": True, "image_mean": list(cfg.data.mean), "image_std": list(cfg.data.std),
        }, indent=2))

    @classmethod
    def load_snippet(cls, cfg: JobConfig) -> str:
        return ("from transformers import pipeline\nclassify = pipeline('image-classification', model=FOLDER)\n"
                "classify('image.png')")

    @classmethod
    def checkpoint_files(cls, cfg: JobConfig, index: ImageIndex) -> dict[str, str]:
        return {"classes.json": json.dumps(index.classes)}  # class index -> name, read back by export

    @classmethod
    def build_cache(cls, cfg: JobConfig, start_ray) -> list[str]:
        return build_decoded_cache(cfg, start_ray)

    # --- worker side ------------------------------------------------------------------------------------
    # loss summed over valid samples, correct predictions, valid samples, undecodable samples (dropped within
    # data.max_bad_samples)
    eval_sum_names = ("loss", "correct", "correct_top5", "samples", "bad_samples")
    eval_batches_repeat = True  # centre-fitted, never augmented: the worker keeps them after the first evaluation
    channels_last = True  # convolutions: on a GPU, weights and input in the tensor cores' layout

    def __init__(self, cfg: JobConfig, index: ImageIndex):
        super().__init__(cfg, index)
        self.index = index
        self.num_train_samples, self.num_val_samples = index.train.num_rows, index.val.num_rows
        # registered and image_classifier models are called as transformers models (the registered RegNets
        # are plain torch with the same interface); a user's builder gets the tensor (a transformers model it
        # returns takes pixel_values as its first argument too)
        self.transformers_model = not registry.is_import_path(cfg.model.name)
        # fine-tuning with another number of classes: the head's weight and bias start fresh (weights.load_weights)
        self.reinit_ok = weights.classification_head(len(index.classes))
        self._decoded_splits, self._decoded_lock = {}, threading.Lock()
        self._mean_std = {}  # device -> (mean, std) tensors, made once: no copy to the device per step

    def build_model(self):
        return build_image_model(self.cfg, self.index.classes)

    def pixel_values(self, batch: dict) -> torch.Tensor:
        """The batch's uint8 NHWC images as the model's float32 NCHW input, normalised on their device."""
        images = batch["image"]
        if images.device not in self._mean_std:
            import torch

            self._mean_std[images.device] = tuple(
                torch.tensor(v, dtype=torch.float32, device=images.device).view(1, 3, 1, 1)
                for v in (self.cfg.data.mean, self.cfg.data.std))
        return normalise(images, batch["valid"], *self._mean_std[images.device],
                         channels_last=images.device.type == "cuda")

    def logits(self, model, images: torch.Tensor) -> torch.Tensor:
        if self.transformers_model:
            return model(pixel_values=images).logits
        out = model(images)
        return out.logits if hasattr(out, "logits") else out

    def train_batches(self, indices, epoch: int, batch_size: int):
        return self._batches("train", indices, epoch, batch_size, train=True)

    def eval_batches(self, indices, batch_size: int, split: str = "val"):
        """Validation-style batches (no augmentation) of the val split, or of the train split."""
        return self._batches(split, indices, 0, batch_size, train=False)

    def example_batch(self, batch_size: int):
        import torch

        device = hosts.device()
        size = self.cfg.data.image_size
        return {"image": torch.randint(0, 256, (batch_size, size, size, 3), dtype=torch.uint8, device=device),
                "label": torch.zeros(batch_size, dtype=torch.long, device=device),
                "valid": torch.ones(batch_size, dtype=torch.bool, device=device)}

    def _batches(self, split, indices, epoch, batch_size, train):
        table = getattr(self.index, split)
        # a split kept otherwise than evaluation fits it (random_resized_crop's views; crop_flip's base where
        # data.eval_crop_pct < 1) is decoded again for evaluation's centre fit
        plan = self.index.cache and self.index.cache[split]
        if plan and (train or (not plan.views and (plan.fit or plan.size) == self.cfg.data.eval_fit())):
            decoded, labels = self._decoded(split)
            batches = cached_batches(decoded, labels, indices, self.cfg.data, seed=self.cfg.train.seed,
                                     epoch=epoch, train=train, batch_size=batch_size)
            # Made (and on GPU pinned) data.prefetch_batches ahead in a thread: the crop and flip overlap the step
            # instead of adding to it. The training thread queues the copy to the device when it takes a batch:
            # the batches waiting in a queue hold no device memory.
            device = hosts.device()
            pin = self.cfg.scaling.use_gpu and device.type != "cpu"
            return _to_device(prefetched(_as_tensors(batches, pin), self.cfg.data.prefetch_batches), device)
        # On GPU, batches are pinned and copied to the device in Ray Data's iterator threads (during the step before)
        return rank_batches(table, indices, self.cfg.data, seed=self.cfg.train.seed, epoch=epoch, train=train,
                            batch_size=batch_size, prefetch_batches=self.cfg.data.prefetch_batches,
                            device=hosts.device(), pin_memory=self.cfg.scaling.use_gpu,
                            world=hosts.current().world)

    def _decoded(self, split: str):
        """The split's decoded cache on this node (built here if this worker is the node's first to ask) and
        its labels; opened once per worker. With data.max_bad_samples 0 an undecodable image ends the run here,
        before training, naming the file."""
        with self._decoded_lock:
            if split not in self._decoded_splits:
                d = self.cfg.data
                decoded = image_cache_build.open_or_build(self.index.cache[split], getattr(self.index, split),
                                                          cpus_per_task=d.cpus_per_task)
                if d.max_bad_samples == 0 and decoded.errors:
                    raise BadSampleError(decoded.errors[min(decoded.errors)])
                labels = getattr(self.index, split).column("label").to_numpy()
                self._decoded_splits[split] = (decoded, labels)
            return self._decoded_splits[split]

    def loss_items(self, batch):
        """With data.max_bad_samples, the micro-batch's samples that carry a loss (decodable, and with mixup or
        cutmix a decodable partner), which vary between micro-batches and ranks: the step weighs each by them, so
        its gradient is the mean over the step's samples (Task.loss_items). Otherwise every sample decodes (or
        the run stops): equal weights, and no all-reduce a step for them."""
        d = self.cfg.data
        if not d.max_bad_samples:
            return None
        valid = batch["valid"]
        return (valid & valid.flip(0) if d.mixup_alpha > 0 or d.cutmix_alpha > 0 else valid).sum()

    def loss(self, model, batch):
        """Mean cross-entropy over the decodable samples (undecodable ones, valid=False, carry no loss), against
        labels smoothed by data.label_smoothing; with mixup or cutmix (data/image/mixing.py) each sample's loss weighs
        its own label and its partner's by their shares of the image."""
        from torch.nn.functional import cross_entropy

        from behemoth.data.image.mixing import mix  # (torch's: the task's driver half imports no torch)

        d = self.cfg.data
        images, labels, valid = self.pixel_values(batch), batch["label"], batch["valid"]
        mixed = mix(images, labels, valid, d.mixup_alpha, d.cutmix_alpha)
        logits = self.logits(model, images if mixed is None else mixed.images)
        per_sample = cross_entropy(logits, labels, reduction="none", label_smoothing=d.label_smoothing)
        if mixed is not None:
            partner = cross_entropy(logits, mixed.partner_labels, reduction="none", label_smoothing=d.label_smoothing)
            per_sample = mixed.share * per_sample + (1 - mixed.share) * partner
            valid = valid & mixed.partner_valid
        valid = valid.float()
        n_valid = valid.sum()
        return (per_sample * valid).sum() / n_valid.clamp(min=1), n_valid

    def eval_sums(self, model, batch):
        from torch.nn.functional import cross_entropy

        valid = batch["valid"]
        logits = self.logits(model, self.pixel_values(batch))
        losses = cross_entropy(logits, batch["label"], reduction="none")
        correct = (logits.argmax(dim=1) == batch["label"]) & valid
        top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices
        correct_top5 = (top5 == batch["label"][:, None]).any(dim=1) & valid
        return {"loss": losses[valid].sum(), "correct": correct.sum(), "correct_top5": correct_top5.sum(),
                "samples": valid.sum(), "bad_samples": (~valid).sum()}

    def eval_metrics(self, sums):
        n = max(sums["samples"], 1.0)
        metrics = {"val_loss": sums["loss"] / n, "val_accuracy": sums["correct"] / n, "val_samples": int(n),
                   "val_bad_samples": int(sums["bad_samples"])}
        if len(self.index.classes) > 5:  # (with 5 classes or fewer every sample is in the top 5)
            metrics["val_top5_accuracy"] = sums["correct_top5"] / n
        return metrics

    def bad_samples(self, batch):
        import torch

        return torch.where(batch["valid"], -1, batch["sample_id"])

    def describe_samples(self, sample_ids):
        return describe_samples(self.index.train, sample_ids)


def build_decoded_cache(cfg: JobConfig, start_ray) -> list[str]:
    """`behemoth data cache`: both splits' decoded caches built on this node (or found complete), whatever
    data.cache says (the job's runs use it unless data.cache is none). `start_ray` is called once the config
    and the data are checked."""
    if not isinstance(cfg.data, ImageData):
        raise ConfigError(f"data.kind {cfg.data.kind}: only image data (image_folder, image_parquet, "
                          f"image_webdataset) has a decoded cache")
    decide = dataclasses.replace(cfg.data, cache="decoded")
    decide.validate()
    index = build_index(cfg.data)
    plans, _ = decide_cache(decide, index)
    start_ray()
    warning = image_cache.network_warning(Path(plans["train"].folder).parent)
    lines = [f"warning: {warning}"] if warning else []
    for split, plan in plans.items():
        decoded = image_cache_build.open_or_build(plan, getattr(index, split),
                                                  cpus_per_task=cfg.data.cpus_per_task, log=lambda line: None)
        lines.append(f"{split}: {plan.rows} images, {decoded.manifest['bytes'] / 1e6:.1f} MB in {plan.folder} "
                     f"({len(decoded.errors)} undecodable)")
    return lines


def _as_tensors(batches, pin: bool):
    """numpy batches as torch tensors, pinned where they go to a GPU (so that the copy there is asynchronous)."""
    import torch

    for batch in batches:
        yield {key: torch.from_numpy(value).pin_memory() if pin else torch.from_numpy(value)
               for key, value in batch.items()}


def _to_device(batches, device):
    """Each batch's tensors on the training device (copied non-blocking from pinned memory)."""
    try:
        for batch in batches:
            yield batch if device.type == "cpu" else {
                key: tensor.to(device, non_blocking=tensor.is_pinned()) for key, tensor in batch.items()}
    finally:
        batches.close()  # an epoch left early: the prefetch thread stops now
