#!/usr/bin/env bash
# behemoth's two set-up-and-run commands (see README):
#   ./run.sh demo   set up, make the demo images, train the demo job on a local Ray instance (2 workers)
#   ./run.sh demo-lm  the same for the language-model demo (generated stories, local BPE tokenizer)
#   ./run.sh demo-chat  the same for chat fine-tuning (generated conversations, the loss on the assistant's turns)
#   ./run.sh demo-dpo  preference tuning (DPO) of the chat demo's model on generated answer pairs (runs the chat
#                   demo first where runs/demo_chat is missing)
#   ./run.sh test   set up, run the quick tier: every unit test and one end-to-end check per capability
#                   (arguments go to pytest: paths narrow it, e.g. tests/unit; see tier() below)
#   ./run.sh test-full  the full tier (CI: .ci/run): every test, with a Ray instance of its own started beside
#                   the suite that must still be alive at its end
#   ./run.sh test-gpu   the GPU tier (one GPU): the real-shape benches first, then the GPU-marked tests, the
#                   pipeline's scaling and the demos; figures to gpu-figures.json. Refuses, after its CPU-side
#                   checks, where no GPU is present
#   ./run.sh gpu-kit [--rehearse]  build gpu-kit/ (wheels for what the lent GPU machine's image lacks; the one
#                   device call that runs the tier there is in docs/testing.md); --rehearse: then install it into
#                   a fresh Python 3.12 as that machine does, start Ray there, and dry-run the device script
# Set-up is idempotent: a virtual environment in .venv (BEHEMOTH_VENV to move it), reinstalled only when
# pyproject.toml changes.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${BEHEMOTH_VENV:-.venv}
# torch is installed first at a pinned version (the CPU build this machine holds on disk; an unpinned torch
# would pull a multi-GB CUDA build). The package itself accepts a range, so GPU users keep their build.
TORCH_SPEC=${BEHEMOTH_TORCH_SPEC:-torch==2.13.0}

quiet_pip() {  # pip's "Location ... is ignored" notes about this machine's local indexes are noise
  "$VENV/bin/pip" "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}

setup() {
  local stamp="$VENV/.behemoth-installed" want
  want="$(sha256sum pyproject.toml | cut -c1-16) $TORCH_SPEC"
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    local began=$SECONDS
    echo "[run.sh] installing behemoth into $VENV (first run: a few minutes)"
    quiet_pip install -q --upgrade pip
    quiet_pip install -q "$TORCH_SPEC"
    quiet_pip install -q -e ".[dev]"
    echo "$want" > "$stamp"
    echo "[run.sh] installed in $((SECONDS - began)) s (before behemoth starts: not in a run's start-up or goodput)"
  fi
}

# exec keeps this shell's process, so /proc would date the Python it starts from this shell's start, before
# the install: the time of the exec goes along (behemoth's tracking/invocation.py process_start reads it).
exec_python() {
  BEHEMOTH_EXEC_TIME=$(date +%s.%N) exec "$@"
}

# A tier's tests. With no test named (options only), the unit tests first, in as many processes as there are
# cores, up to 4 (they start no Ray instance; each one's own processes and threads are few), then the end-to-end
# tests in one process, each of them needing the cores for its Ray instance; the exit status is the worse of the
# two. With a test named (a path, -k EXPR, ...): one process, as named. $1: the tier's -m expression ("": all).
tier() {
  local select=() unit_args=() arg cores unit=0 end_to_end=0
  [ -z "$1" ] || select=(-m "$1")
  shift
  for arg in "$@"; do
    [[ $arg == -* ]] || exec_python "$VENV/bin/python" -m pytest "${select[@]}" "$@"  # pyproject testpaths = tests
    [ "$arg" = --bystander-ray ] || unit_args+=("$arg")  # the Ray instance beside the suite: the end-to-end part's
  done
  cores=$(nproc)
  [ "$cores" -lt 2 ] || unit_args+=(-n "$(( cores < 4 ? cores : 4 ))" --dist loadfile)
  "$VENV/bin/python" -m pytest "${select[@]}" "${unit_args[@]}" tests/unit || unit=$?
  "$VENV/bin/python" -m pytest "${select[@]}" "$@" tests/integration || end_to_end=$?
  return $(( unit > end_to_end ? unit : end_to_end ))
}

cmd=${1:-}
shift || true
case "$cmd" in
  demo)
    setup
    [ -d data/demo_images/train ] || "$VENV/bin/behemoth" data synth-images --out data/demo_images
    exec_python "$VENV/bin/behemoth" train jobs/configs/demo_images.yaml "$@"
    ;;
  demo-lm)
    setup
    [ -f data/demo_text/train.jsonl ] || "$VENV/bin/behemoth" data synth-text --out data/demo_text
    [ -f data/demo_text/tokenizer/tokenizer.json ] || "$VENV/bin/behemoth" data train-tokenizer \
      data/demo_text/train.jsonl --vocab-size 1024 --out data/demo_text/tokenizer
    exec_python "$VENV/bin/behemoth" train jobs/configs/demo_lm.yaml "$@"
    ;;
  demo-chat)
    setup
    [ -f data/demo_chat/train.jsonl ] || "$VENV/bin/behemoth" data synth-text --chat --out data/demo_chat
    [ -f data/demo_chat/tokenizer/tokenizer.json ] || "$VENV/bin/behemoth" data train-tokenizer \
      data/demo_chat/train.jsonl --chat --vocab-size 1024 --out data/demo_chat/tokenizer
    exec_python "$VENV/bin/behemoth" train jobs/configs/demo_chat.yaml "$@"
    ;;
  demo-dpo)
    setup
    [ -d runs/demo_chat ] || "$0" demo-chat
    [ -f data/demo_preference/train.jsonl ] || "$VENV/bin/behemoth" data synth-text --preference --seed 1 \
      --out data/demo_preference
    exec_python "$VENV/bin/behemoth" train jobs/configs/demo_dpo.yaml "$@"
    ;;
  test)
    setup
    # the quick tier: an end-to-end test (tests/integration) runs here only when it is marked quick
    tier "quick or not integration" "$@"
    ;;
  test-full)
    setup
    tier "" --bystander-ray "$@"
    ;;
  test-gpu)
    setup
    exec_python "$VENV/bin/python" tests/gpu_tier.py "$@"
    ;;
  gpu-kit)
    setup
    "$VENV/bin/python" tests/gpu_kit.py build
    if [ "${1:-}" = "--rehearse" ]; then
      exec "$VENV/bin/python" tests/gpu_kit.py rehearse
    fi
    ;;
  *)
    echo "usage: ./run.sh demo|demo-lm|demo-chat|demo-dpo [--set KEY=VALUE ...] | ./run.sh test|test-full [pytest args] | ./run.sh test-gpu | ./run.sh gpu-kit [--rehearse]" >&2
    exit 2
    ;;
esac
