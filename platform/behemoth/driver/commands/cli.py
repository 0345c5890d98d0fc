"""`behemoth train|check|data ...`: the command line. Thin: parse arguments, call the library, print."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import yaml

from behemoth.version import __version__
from behemoth.config import dump_yaml
from behemoth.job import load_config
from behemoth.errors import ConfigError, user_facing_error



def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="job YAML, e.g. jobs/configs/demo_images.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.lr=0.05 (repeatable)")


def _image_size(text: str):
    """`32` (a side) or `500x375` (width x height)."""
    parts = text.lower().split("x")
    try:
        sizes = [int(p) for p in parts]
    except ValueError:
        sizes = []
    if len(sizes) not in (1, 2) or min(sizes) < 8:
        raise argparse.ArgumentTypeError(f"{text!r}: give a side (32) or WIDTHxHEIGHT (500x375), each >= 8")
    return sizes[0] if len(sizes) == 1 else tuple(sizes)


def _int_between(low: int, high: int):
    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not between {low} and {high}")
        return value

    return parse


def _positive(what: str, high: float):
    """A number more than 0 and at most `high` (nan, inf, 0 and negatives refused in one line)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not 0 < value <= high:
            raise argparse.ArgumentTypeError(f"{text!r}: give {what}, more than 0 and at most {high:g}")
        return value

    return parse


# `spot-watch --interval`: at most 30 s, GCE's whole notice (a longer interval could read a notice after its VM is
# gone; -1 or nan ended the watcher at its first sleep, 0 asks the service without pause)
_poll_interval = _positive("seconds between two reads", 30)


def _import_path(what: str):
    def parse(text: str) -> str:
        module, _, attr = text.partition(":")
        if not (module and attr):
            raise argparse.ArgumentTypeError(f"{text!r} is not an import path: give module:{what}")
        return text

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="behemoth", description="Fault-tolerant distributed training on Ray (Ray Data + Ray Train DDP).",
        epilog="Exit status: 0 success; 1 a data error, a damaged checkpoint or a failed run (one line says "
               "which); 2 a config error or bad arguments. Also: python -m behemoth ...")
    parser.add_argument("--version", action="version", version=f"behemoth {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train (or resume, same checkpoint.run_name) a job on Ray")
    _add_config_args(p)

    p = sub.add_parser("tune", help="sweep a job's keys (batch size, learning rate, ...) with Ray Tune; rerun "
                       "the same sweep name to resume it")
    p.add_argument("sweep", help="sweep YAML, e.g. jobs/configs/sweep_demo.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a sweep key, e.g. --set name=lr2, or a job key for every trial, e.g. --set "
                   "data.root=/abs/path (repeatable)")

    p = sub.add_parser("eval", help="evaluate a checkpoint with the job's data pipeline and workers; print the "
                       "metrics and write them as JSON next to the checkpoint")
    _add_config_args(p)
    p.add_argument("--checkpoint", required=True, help="a checkpoint folder, a run folder (its best checkpoint; "
                   "--latest: its latest) or a Hugging Face folder whose weights fit the job's model; local or a URI "
                   "(s3://...)")
    p.add_argument("--split", choices=["val", "train"], default="val", help="what to evaluate (train: the "
                   "training samples without augmentation)")
    p.add_argument("--latest", action="store_true", help="a run folder's latest checkpoint instead of its best")

    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face model folder (save_pretrained: "
                       "safetensors, config with labels, image processor or tokenizer, model card)")
    p.add_argument("checkpoint", help="a checkpoint folder, or a run folder (its best checkpoint by default)")
    p.add_argument("--out", required=True, help="a new (or empty) folder to write")
    pick = p.add_mutually_exclusive_group()
    pick.add_argument("--best", dest="which", action="store_const", const="best", default="best",
                      help="a run folder's best checkpoint by the task's metric (default)")
    pick.add_argument("--latest", dest="which", action="store_const", const="latest",
                      help="a run folder's latest checkpoint")
    _add_trusted_code_args(p)
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template to export instead of the one the "
                   "checkpoint keeps (the run's); needed for a checkpoint written before behemoth kept it, whose "
                   "job.yaml names a template file: behemoth reads no file a checkpoint names")
    _add_generate_command(sub)

    p = sub.add_parser("report", help="write a run's (or a sweep's) report: FOLDER/report/report.html with its "
                       "plots embedded, and the PNGs (`behemoth train` writes it at the end of every run)")
    p.add_argument("folder", help="a run folder (STORAGE_PATH/RUN_NAME) or a sweep folder (with results.csv)")

    _add_check_commands(sub)
    _add_data_commands(sub.add_parser("data", help="data utilities").add_subparsers(dest="data_command",
                                                                                      required=True))
    return parser


def _add_trusted_code_args(p: argparse.ArgumentParser) -> None:
    """A checkpoint's job.yaml is data from whoever wrote it: code it names runs only when named here too, and
    no file it names is read (the tokenizer: the one the checkpoint keeps, or --tokenizer)."""
    p.add_argument("--model-code", type=_import_path("function"), metavar="MODULE:FUNCTION",
                   help="import this model builder (a checkpoint whose model.name is one by import path: behemoth "
                   "imports no code that only the checkpoint names)")
    p.add_argument("--task-code", type=_import_path("Class"), metavar="MODULE:CLASS",
                   help="import this task (a checkpoint whose data.kind is one by import path)")
    p.add_argument("--trust-remote-code", action="store_true", help="run the code of the checkpoint's "
                   "model.pretrained repository (its job.yaml's model.trust_remote_code is never honoured alone)")
    p.add_argument("--tokenizer", metavar="FOLDER", help="a tokenizer to use instead of the one the checkpoint "
                   "keeps (the run's); needed for a checkpoint written before behemoth kept it: behemoth reads no "
                   "file a checkpoint's job.yaml names")


def _add_generate_command(sub) -> None:
    p = sub.add_parser("generate", help="print a causal LM's completions of prompts (greedy, or sampled with "
                       "--temperature > 0), from a checkpoint, a run folder or an exported Hugging Face folder; "
                       "no Ray, the GPU if there is one")
    p.add_argument("model", metavar="CHECKPOINT_OR_EXPORT", help="a behemoth checkpoint folder, a run folder (its "
                   "best checkpoint; --latest: its latest) or a Hugging Face folder (behemoth export's)")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", help="one prompt (text)")
    given.add_argument("--prompts", metavar="FILE", help="a prompt per line, or JSONL (.jsonl) rows with "
                       "\"prompt\" (text) or \"messages\" (a conversation, rendered with the chat template)")
    p.add_argument("--chat", action="store_true", help="render text prompts as a user's turn with the tokenizer's "
                   "chat template and its generation prompt (messages rows always are)")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template to use instead of the tokenizer's "
                   "(a checkpoint's: the one it keeps, the run's)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample at this "
                   "temperature")
    p.add_argument("--top-p", type=float, help="sampling: keep the most likely tokens up to this probability mass")
    p.add_argument("--top-k", type=int, help="sampling: keep the k most likely tokens")
    p.add_argument("--seed", type=int, default=0, help="sampling: torch's seed before each prompt (default 0)")
    p.add_argument("--latest", action="store_true", help="a run folder's latest checkpoint instead of its best")
    _add_trusted_code_args(p)


def _add_check_commands(sub) -> None:
    """`behemoth check | check-cluster | check-nodes`: what can be checked before a run."""
    p = sub.add_parser("check", help="validate a job config and its data without starting Ray; print it (a sweep "
                       "YAML: the sweep, every trial's job and each data)")
    _add_config_args(p)

    p = sub.add_parser("check-cluster", help="validate a Ray cluster YAML (`ray up`'s, or a KubeRay RayCluster or "
                       "RayJob manifest) offline against its schema and lint it")
    p.add_argument("cluster_yaml", help="the cluster config for `ray up` (cluster.yaml) or a KubeRay manifest "
                   "(deploy/kuberay/*.yaml)")
    p.add_argument("--job", dest="jobs", action="append", default=[], metavar="JOB_YAML",
                   help="also check a job config meant for this cluster (e.g. its checkpoint storage path)")

    p = sub.add_parser("check-nodes", help="on a running Ray cluster (RAY_ADDRESS, or this machine's `ray start`): "
                       "does every node see the job's local paths (data, model, init_from, checkpoint storage)?")
    _add_config_args(p)

    p = sub.add_parser("spot-watch", help="on a spot node (cluster.yaml starts it after `ray start`): wait for the "
                       "cloud's preemption notice, then drain this Ray node with its deadline, so the run checkpoints "
                       "before the node goes (docs/clusters.md)")
    p.add_argument("--cloud", choices=["aws", "gce"], required=True, help="whose metadata service to read")
    p.add_argument("--metadata-url", help="the metadata service's plain HTTP address, http://HOST[:PORT] (default: "
                   "the cloud's own)")
    p.add_argument("--address", help="the cluster's GCS address, host:port (default: this node's `ray start`)")
    p.add_argument("--node-id", help="this node's Ray node id (default: the node listening on this host's address)")
    p.add_argument("--interval", type=_poll_interval, default=5.0, help="seconds between two reads of the notice, "
                   "more than 0 and at most 30 (default 5)")


def _add_data_commands(data) -> None:
    """`behemoth data ...`: demo data, a local tokenizer, an image job's decoded cache."""
    p = data.add_parser("synth-images", help="write a learnable demo image dataset (ImageFolder of PNGs, or of "
                        "ImageNet-shaped, photograph-like JPEGs with --format jpeg)")
    p.add_argument("--out", required=True, help="output folder; train/ and val/ are created inside")
    p.add_argument("--classes", type=_int_between(1, 10), default=10, help="number of classes, 1 to 10")
    p.add_argument("--per-class", type=int, default=200, help="training images per class")
    p.add_argument("--val-per-class", type=int, default=50, help="validation images per class")
    p.add_argument("--format", choices=["png", "jpeg"], default="png", help="png: the demo's small squares; "
                   "jpeg: photograph-like textures at ImageNet's shapes and file sizes (70 %% landscape, 20 %% "
                   "portrait, 10 %% twice as large)")
    p.add_argument("--size", type=_image_size, default=None, help="png: the side in pixels (default 32); jpeg: "
                   "WIDTHxHEIGHT of the landscape images (default 500x375)")
    p.add_argument("--seed", type=int, default=0, help="random seed (the same seed writes the same data)")

    p = data.add_parser("split-val", help="move ImageNet's flat validation images into one folder per class "
                        "(in place), from Kaggle's LOC_val_solution.csv or lines of 'FILENAME CLASS'")
    p.add_argument("folder", help="the flat validation folder, e.g. /data/imagenet/val")
    p.add_argument("--labels", required=True, help="LOC_val_solution.csv, or a text file of 'FILENAME CLASS' lines")
    p.add_argument("--undo", action="store_true", help="move the labelled images from their class folders back "
                   "into the folder (after a split stopped midway, or to start over)")

    _add_text_data_commands(data)

    p = data.add_parser("shards", help="write an ImageFolder as WebDataset tar shards (KEY.<png|jpg> + KEY.cls per "
                        "image, classes.txt), for data.kind image_webdataset; samples keep the folder's order")
    p.add_argument("root", help="the ImageFolder: ROOT/{train,val}/<class>/*.{png,jpg,jpeg}")
    p.add_argument("--out", required=True, help="output folder: {train,val}-NNNNNN.tar and classes.txt")
    p.add_argument("--samples-per-shard", type=_int_between(1, 10**9), default=10000, help="images per tar shard")

    p = data.add_parser("cache", help="decode an image job's images once into this node's cache (data.cache_dir) "
                        "ahead of training, with Ray Data on a local Ray instance; its runs then read it")
    _add_config_args(p)

    p = data.add_parser("bench", help="run a job's training input pipeline alone (one consumer per worker, as its "
                        "workers receive it, no model) and print samples/s, per CPU, bytes per sample and how "
                        "many workers it keeps fed (docs/speed.md)")
    _add_config_args(p)
    p.add_argument("--seconds", type=_positive("seconds to measure", 86400), default=20.0, help="how long to "
                   "measure after every consumer's first batch, more than 0 (default 20)")
    p.add_argument("--cpus", type=_int_between(1, 1 << 16), help="start the local Ray instance with this many CPUs "
                   "(how the pipeline scales with the CPUs it is given); default: all of the machine's")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--step-rate", type=_positive("steps per second", 1e9), help="optimizer steps per second one "
                      "worker takes when fed (for 'feeds N workers')")
    rate.add_argument("--run", help="a run folder of this job: its measured step rate is used")


def _add_text_data_commands(data) -> None:
    """`behemoth data synth-text` and `train-tokenizer`: the demo corpora and a local tokenizer."""
    p = data.add_parser("synth-text", help="write a learnable demo text corpus (train.jsonl, val.jsonl)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--labelled", action="store_true", help="stories with a label each (their character's mood: 4 "
                   "classes), for text classification: rows {text, label}")
    p.add_argument("--chat", action="store_true", help="conversations about the stories, for chat fine-tuning "
                   "(data.kind chat): rows {messages: [{role, content}, ...]}")
    p.add_argument("--preference", action="store_true", help="pairs of answers about the stories, the story's and "
                   "a wrong one, for preference tuning (data.kind preference): rows {prompt, chosen, rejected}")
    p.add_argument("--train-documents", type=int, default=4000, help="stories in train.jsonl")
    p.add_argument("--val-documents", type=int, default=400, help="stories in val.jsonl")
    p.add_argument("--seed", type=int, default=0, help="random seed (the same seed writes the same data)")

    p = data.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer on text files, saved for "
                        "AutoTokenizer.from_pretrained (EOS <|endoftext|>)")
    p.add_argument("files", nargs="+", help=".txt, .jsonl or .parquet files (as data.train_files reads them)")
    p.add_argument("--out", required=True, help="output folder (use it as data.tokenizer)")
    p.add_argument("--vocab-size", type=int, default=4096, help="tokens in the vocabulary, special tokens included")
    p.add_argument("--text-field", default="text", help="JSONL field / parquet column (data.text_field)")
    p.add_argument("--document", choices=["line", "file"], default="line", help=".txt: a document per line "
                   "or per file (data.document)")
    p.add_argument("--chat", action="store_true", help="the files are conversations (data.kind chat; --text-field "
                   "names their messages field, default messages): trained on every turn's content, with ChatML's "
                   "<|im_start|> and <|im_end|> as tokens and ChatML as the chat template")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except ConfigError as e:
        print(f"behemoth: config error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # data errors and training failures: one clear line, then the exit code
        message = user_facing_error(e)
        if message is None:
            raise
        print(f"behemoth: error: {message}", file=sys.stderr)
        return 1


def run(argv: list[str] | None = None) -> None:
    """The `behemoth` command and `python -m behemoth`: main(), then the process ends at once."""
    exit_at_once(main(argv))


def run_command(argv: list[str]) -> None:
    """`behemoth.cli(argv)`: the `behemoth` command with these arguments, in this process (jobs/*.py under
    `ray job submit`), which then ends with its status (2: a config error, 1: a data or run failure)."""
    run(list(argv))


def exit_at_once(status: int) -> None:
    """End this process with `status` once everything written is out: streams flushed, the atexit handlers run
    (behemoth's console, logging's, Ray's shutdown). What it skips is the interpreter's own teardown, which
    with Ray's, torch's and gloo's native libraries loaded takes seconds after the last handler, with no
    Python frame left to run and nothing written: a wait for nothing at every run's end."""
    import atexit
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _dispatch(args) -> int:
    if args.command == "check-cluster":
        from behemoth.driver.commands.cluster_check import check_cluster

        findings = check_cluster(args.cluster_yaml, args.jobs)
        for finding in findings:
            print(f"{args.cluster_yaml}: {finding}", file=sys.stderr)
        print(f"{args.cluster_yaml}: {len(findings)} problem(s)" if findings else f"{args.cluster_yaml}: OK")
        return 1 if findings else 0
    if args.command == "check-nodes":
        from behemoth.driver.commands.node_check import report_nodes

        return report_nodes(load_config(args.config, args.overrides))
    if args.command == "spot-watch":
        from behemoth.driver.commands.spot_watch import run as watch

        return watch(args.cloud, args.metadata_url, args.address, args.node_id, args.interval)
    if args.command == "data":
        return _data_command(args)
    if args.command == "tune":
        return _tune_command(args)
    if args.command == "report":
        from behemoth.tracking.run_report import write_report

        print(f"[behemoth] report: {write_report(args.folder)}")
        return 0
    if args.command == "export":
        from behemoth.driver.commands.export import TrustedCode, export

        trusted = TrustedCode(args.model_code, args.task_code, args.trust_remote_code, args.tokenizer,
                              args.chat_template)
        out, source = export(args.checkpoint, args.out, args.which, trusted)
        print(f"[behemoth] exported {source}\n  to {out} (load with transformers' from_pretrained / pipeline; "
              f"see its README.md)")
        return 0
    if args.command == "generate":
        return _generate_command(args)
    if args.command == "check" and _is_sweep(args.config):
        from behemoth.driver.sweep.config import check_sweep_file

        return check_sweep_file(args.config, args.overrides)
    cfg = load_config(args.config, args.overrides)
    if args.command == "eval":
        from behemoth.driver.run.evaluation import evaluate_checkpoint

        metrics, written = evaluate_checkpoint(cfg, args.checkpoint, args.split, "latest" if args.latest else "best")
        print("\n".join(["[behemoth] evaluation finished", *[f"  {k}: {v}" for k, v in metrics.items()],
                         f"  written to {written}"]))
        return 0
    if args.command == "check":
        return _check_command(cfg)
    from behemoth.driver.run.trainer import train
    from behemoth.tracking.invocation import process_start

    summary = train(cfg, process_start=process_start(), end_ray=True)
    print("\n".join(["[behemoth] run finished"] + [f"  {line}" for line in summary.lines()]))
    return 0


def _check_command(cfg) -> int:
    """`behemoth check JOB.yaml`: the data checked, the config shown, what a joining node needs, the feed."""
    from behemoth.driver.commands.data_bench import feed_check

    checked = _check_data(cfg)  # (before the config is shown: a data error is then the one line printed)
    print(dump_yaml(cfg), end="")
    print(f"# data: {checked}")
    print(f"# nodes: {_node_paths_line(cfg)}")
    line, warning = feed_check(cfg)
    print(f"# feed: {line}")
    if warning:
        print(f"behemoth: warning: {warning}", file=sys.stderr)
    return 0


def _generate_command(args) -> int:
    from behemoth.driver.commands.export import TrustedCode
    from behemoth.driver.commands.generate import Sampling, load_generator, read_prompts

    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed)
    sampling.validate()  # (before the model loads)
    prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts)
    generator = load_generator(args.model, "latest" if args.latest else "best",
                               TrustedCode(args.model_code, args.task_code, args.trust_remote_code, args.tokenizer),
                               args.chat_template)
    print(f"[behemoth] generate: {generator.source}; {sampling.describe()}", flush=True)
    for n, done in enumerate(generator.run(prompts, sampling, args.chat), 1):
        shown = done.prompt if isinstance(done.prompt, str) else json.dumps(done.prompt, ensure_ascii=False)
        print(f"--- prompt {n}: {shown}\n{done.text}", flush=True)
    return 0


def _tune_command(args) -> int:
    import pandas as pd

    from behemoth.driver.sweep.config import load_sweep
    from behemoth.driver.sweep.tuner import run_sweep

    result = run_sweep(load_sweep(args.sweep, args.overrides))
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.max_colwidth", 60):
        print(result.table.drop(columns=["run_dir"]).to_string(index=False))
    print("\n".join([
        f"[behemoth] sweep finished: best {result.metric} {result.best_value:.4f} with "
        + ", ".join(f"{k}={v}" for k, v in result.best_params.items()),
        f"  results:         {result.results_csv}",
        f"  best job config: {result.best_yaml}   (behemoth train {result.best_yaml})",
        f"  best checkpoint: {result.best_checkpoint}"]))
    return 0


def _data_command(args) -> int:
    if args.data_command == "synth-images":
        from behemoth.data.synth import write_synth_images

        size = args.size or ((500, 375) if args.format == "jpeg" else 32)
        if args.format == "png" and not isinstance(size, int):
            raise ConfigError(f"--size {args.size[0]}x{args.size[1]}: PNG demo images are square: give one side")
        counts = write_synth_images(args.out, args.classes, args.per_class, args.val_per_class, size, args.seed,
                                    args.format)
        print(f"wrote {counts['train']} train and {counts['val']} val images to {args.out}")
    elif args.data_command == "synth-text":
        from behemoth.data import synth_text

        if args.labelled + args.chat + args.preference > 1:
            raise ConfigError("synth-text: --labelled, --chat and --preference write different corpora: give one")
        write = (synth_text.write_synth_labelled_text if args.labelled else synth_text.write_synth_chat if args.chat
                 else synth_text.write_synth_preference if args.preference else synth_text.write_synth_text)
        counts = write(args.out, args.train_documents, args.val_documents, args.seed)
        print(f"wrote {counts['train']} train and {counts['val']} val documents to {args.out}/{{train,val}}.jsonl")
    elif args.data_command == "split-val":
        from behemoth.data.imagenet import split_val

        result = split_val(Path(args.folder), Path(args.labels), undo=args.undo)
        moved = sum(result.moved.values())
        print(f"moved {moved} images back into {args.folder}" if args.undo else
              f"moved {moved} images into {len(result.moved)} class folders of {args.folder}"
              + (f" ({result.in_place} were already in place)" if result.in_place else ""))
    elif args.data_command == "shards":
        from behemoth.data.image_shards import write_shards
        from behemoth.data.images import index_image_folder

        out = Path(args.out)
        written = write_shards(index_image_folder(Path(args.root)), out, args.samples_per_shard)
        print(f"wrote {written['train']} train and {written['val']} val shards to {out}; train on them with\n"
              f"  data: {{kind: image_webdataset, train_files: [{out}/train-*.tar], val_files: [{out}/val-*.tar]}}")
    elif args.data_command == "bench":
        from behemoth.driver.commands.data_bench import bench_data, record

        cfg = load_config(args.config, args.overrides)
        result = bench_data(cfg, args.seconds, args.step_rate, args.run, args.cpus)
        kept = record(cfg, result)
        print("\n".join([*([f"kept for `behemoth check` on this machine: {kept}"] if kept else []),
                         *result.lines()]))
    elif args.data_command == "cache":
        from behemoth.driver.ray_cluster.session import ensure_ray
        from behemoth.tasks import task_of

        cfg = load_config(args.config, args.overrides)
        for line in task_of(cfg).build_cache(cfg, start_ray=ensure_ray):
            print(line)
    else:
        from behemoth.data.tokenizer import train_tokenizer

        tok = train_tokenizer(args.files, args.out, args.vocab_size, args.text_field, args.document, chat=args.chat)
        print(f"wrote a byte-level BPE tokenizer ({len(tok)} tokens, eos {tok.eos_token!r}) to {args.out}")
    return 0


def _is_sweep(path: str) -> bool:
    """A sweep YAML (job: and space: at its top) rather than a job's."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False  # (the job loader says what is wrong with it)
    return isinstance(raw, dict) and "job" in raw and "space" in raw


def _node_paths_line(cfg) -> str:
    """What a node that joins later (a spot replacement) must hold itself: the job's local paths (object-store
    URIs and Hub names each node fetches)."""
    from behemoth.driver.commands.node_check import job_paths

    paths = job_paths(cfg)
    if not paths:
        return "a node that joins needs none of the job's paths on its disk (all in object storage or the Hub)"
    held = [f"{k} {v}" + (" (or the folder it is made in)" if k == "data.cache_dir" else "") for k, v in paths.items()]
    return (f"a node that joins must hold {', '.join(held)} (on its image or a shared filesystem; "
            f"`behemoth check-nodes` asks every node of a running cluster)")


def _check_data(cfg) -> str:
    """What the task can check without Ray (images: indexed; text: files, columns and the tokenizer), and what
    the preflight can (driver/run/preflight.py: model and tokenizer sources, init_from, an epoch's steps)."""
    from behemoth.driver.run.sequence import check_data
    from behemoth.tasks import task_of

    task = task_of(cfg)
    return task.describe(cfg, check_data(cfg, task))


if __name__ == "__main__":
    run()
