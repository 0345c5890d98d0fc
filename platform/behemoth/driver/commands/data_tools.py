"""`behemoth data ...`: demo data, ImageNet's validation split, WebDataset shards, a local tokenizer, an image job's
decoded cache, and the input pipeline measured alone."""

from __future__ import annotations

from pathlib import Path

from behemoth.driver.commands.args import add_config_args, image_size, int_between, positive
from behemoth.errors import ConfigError
from behemoth.storage.paths import local_out_folder

COUNT = int_between(1, 10**9)  # images or documents: 0 or a negative one wrote an empty split and said "wrote -50"
SEED = int_between(0, 2**32 - 1)  # numpy refuses a negative seed with a raw ValueError


def add_command(sub) -> None:
    data = sub.add_parser("data", help="data utilities").add_subparsers(dest="data_command", required=True)
    p = data.add_parser("synth-images", help="write a learnable demo image dataset (ImageFolder of PNGs, or of "
                        "ImageNet-shaped, photograph-like JPEGs with --format jpeg)")
    p.add_argument("--out", required=True, help="a new or empty output folder; train/ and val/ are created inside")
    p.add_argument("--classes", type=int_between(1, 10), default=10, help="number of classes, 1 to 10")
    p.add_argument("--per-class", type=COUNT, default=200, help="training images per class")
    p.add_argument("--val-per-class", type=COUNT, default=50, help="validation images per class")
    p.add_argument("--format", choices=["png", "jpeg"], default="png", help="png: the demo's small squares; "
                   "jpeg: photograph-like textures at ImageNet's shapes and file sizes (70 %% landscape, 20 %% "
                   "portrait, 10 %% twice as large)")
    p.add_argument("--size", type=image_size, default=None, help="png: the side in pixels (default 32); jpeg: "
                   "WIDTHxHEIGHT of the landscape images (default 500x375)")
    p.add_argument("--seed", type=SEED, default=0, help="random seed (the same seed writes the same data)")
    p.set_defaults(handler=synth_images)

    p = data.add_parser("split-val", help="move ImageNet's flat validation images into one folder per class "
                        "(in place), from Kaggle's LOC_val_solution.csv or lines of 'FILENAME CLASS'")
    p.add_argument("folder", help="the flat validation folder, e.g. /data/imagenet/val")
    p.add_argument("--labels", required=True, help="LOC_val_solution.csv, or a text file of 'FILENAME CLASS' lines")
    p.add_argument("--undo", action="store_true", help="move the labelled images from their class folders back "
                   "into the folder (after a split stopped midway, or to start over)")
    p.set_defaults(handler=split_val)

    _add_text_commands(data)

    p = data.add_parser("shards", help="write an ImageFolder as WebDataset tar shards (KEY.<png|jpg|...> + KEY.cls per "
                        "image, classes.txt), for data.kind image_webdataset; samples keep the folder's order")
    p.add_argument("root", help="the ImageFolder: ROOT/{train,val}/<class>/*.{png,jpg,jpeg,webp,bmp,gif,tif,tiff}")
    p.add_argument("--out", required=True, help="output folder: {train,val}-NNNNNN.tar and classes.txt")
    p.add_argument("--samples-per-shard", type=int_between(1, 10**9), default=10000, help="images per tar shard")
    p.set_defaults(handler=shards)

    p = data.add_parser("cache", help="decode an image job's images once into this node's cache (data.cache_dir) "
                        "ahead of training, with Ray Data on a local Ray instance; its runs then read it")
    add_config_args(p)
    p.set_defaults(handler=cache)

    p = data.add_parser("bench", help="run a job's training input pipeline alone (one consumer per worker, as its "
                        "workers receive it, no model) and print samples/s, per CPU, bytes per sample and how "
                        "many workers it keeps fed (docs/speed.md)")
    add_config_args(p)
    p.add_argument("--seconds", type=positive("seconds to measure", 86400), default=20.0, help="how long to "
                   "measure after every consumer's first batch, more than 0 (default 20)")
    p.add_argument("--cpus", type=int_between(1, 1 << 16), help="start the local Ray instance with this many CPUs "
                   "(how the pipeline scales with the CPUs it is given); default: all of the machine's")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--step-rate", type=positive("steps per second", 1e9), help="optimizer steps per second one "
                      "worker takes when fed (for 'feeds N workers')")
    rate.add_argument("--run", help="a run folder of this job: its measured step rate is used")
    p.set_defaults(handler=bench)


def _add_text_commands(data) -> None:
    """`behemoth data synth-text` and `train-tokenizer`: the demo corpora and a local tokenizer."""
    p = data.add_parser("synth-text", help="write a learnable demo text corpus (train.jsonl, val.jsonl)")
    p.add_argument("--out", required=True, help="output folder, holding no train.jsonl or val.jsonl (nothing is "
                   "written over)")
    p.add_argument("--labelled", action="store_true", help="stories with a label each (their character's mood: 4 "
                   "classes), for text classification: rows {text, label}")
    p.add_argument("--chat", action="store_true", help="conversations about the stories, for chat fine-tuning "
                   "(data.kind chat): rows {messages: [{role, content}, ...]}")
    p.add_argument("--preference", action="store_true", help="pairs of answers about the stories, the story's and "
                   "a wrong one, for preference tuning (data.kind preference): rows {prompt, chosen, rejected}")
    p.add_argument("--train-documents", type=COUNT, default=4000, help="stories in train.jsonl")
    p.add_argument("--val-documents", type=COUNT, default=400, help="stories in val.jsonl")
    p.add_argument("--seed", type=SEED, default=0, help="random seed (the same seed writes the same data)")
    p.set_defaults(handler=synth_text)

    p = data.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer on text files, saved for "
                        "AutoTokenizer.from_pretrained (EOS <|endoftext|>)")
    p.add_argument("files", nargs="+", help=".txt, .jsonl or .parquet files (as data.train_files reads them)")
    p.add_argument("--out", required=True, help="output folder holding no tokenizer yet (use it as data.tokenizer)")
    p.add_argument("--vocab-size", type=int, default=4096, help="tokens in the vocabulary, special tokens included "
                   "(at least 257, 259 with --chat; at most 1,000,000)")
    p.add_argument("--text-field", default="text", help="JSONL field / parquet column (data.text_field)")
    p.add_argument("--document", choices=["line", "file"], default="line", help=".txt: a document per line "
                   "or per file (data.document)")
    p.add_argument("--chat", action="store_true", help="the files are conversations (data.kind chat; --text-field "
                   "names their messages field, default messages): trained on every turn's content, with ChatML's "
                   "<|im_start|> and <|im_end|> as tokens and ChatML as the chat template")
    p.set_defaults(handler=train_tokenizer)


def synth_images(args) -> int:
    from behemoth.data.image.synth import write_synth_images

    size = args.size or ((500, 375) if args.format == "jpeg" else 32)
    if args.format == "png" and not isinstance(size, int):
        raise ConfigError(f"--size {args.size[0]}x{args.size[1]}: PNG demo images are square: give one side")
    counts = write_synth_images(local_out_folder(args.out), args.classes, args.per_class, args.val_per_class, size,
                                args.seed, args.format)
    print(f"wrote {counts['train']} train and {counts['val']} val images to {args.out}")
    return 0


def synth_text(args) -> int:
    from behemoth.data.text import synth_text as synth

    if args.labelled + args.chat + args.preference > 1:
        raise ConfigError("synth-text: --labelled, --chat and --preference write different corpora: give one")
    write = (synth.write_synth_labelled_text if args.labelled else synth.write_synth_chat if args.chat
             else synth.write_synth_preference if args.preference else synth.write_synth_text)
    counts = write(local_out_folder(args.out), args.train_documents, args.val_documents, args.seed)
    print(f"wrote {counts['train']} train and {counts['val']} val documents to {args.out}/{{train,val}}.jsonl")
    return 0


def split_val(args) -> int:
    from behemoth.data.image.imagenet import split_val as split

    result = split(Path(args.folder), Path(args.labels), undo=args.undo)
    moved = sum(result.moved.values())
    print(f"moved {moved} images back into {args.folder}" if args.undo else
          f"moved {moved} images into {len(result.moved)} class folders of {args.folder}"
          + (f" ({result.in_place} were already in place)" if result.in_place else ""))
    return 0


def shards(args) -> int:
    from behemoth.data.image.image_shards import write_shards
    from behemoth.data.image.images import index_image_folder

    out = local_out_folder(args.out)
    written = write_shards(index_image_folder(Path(args.root)), out, args.samples_per_shard)
    print(f"wrote {written['train']} train and {written['val']} val shards to {out}; train on them with\n"
          f"  data: {{kind: image_webdataset, train_files: [{out}/train-*.tar], val_files: [{out}/val-*.tar]}}")
    return 0


def bench(args) -> int:
    from behemoth.driver.commands.data_bench import bench_data, record
    from behemoth.job import load_config

    cfg = load_config(args.config, args.overrides)
    result = bench_data(cfg, args.seconds, args.step_rate, args.run, args.cpus)
    kept = record(cfg, result)
    print("\n".join([*([f"kept for `behemoth check` on this machine: {kept}"] if kept else []), *result.lines()]))
    return 0


def cache(args) -> int:
    from behemoth.driver.ray_cluster.session import ensure_ray
    from behemoth.job import load_config
    from behemoth.tasks import task_of

    cfg = load_config(args.config, args.overrides)
    for line in task_of(cfg).build_cache(cfg, start_ray=ensure_ray):
        print(line)
    return 0


def train_tokenizer(args) -> int:
    from behemoth.data.tokenizer import train_tokenizer as train

    tok = train(args.files, local_out_folder(args.out), args.vocab_size, args.text_field, args.document, chat=args.chat)
    print(f"wrote a byte-level BPE tokenizer ({len(tok)} tokens, eos {tok.eos_token!r}) to {args.out}")
    return 0

