"""Ray Data pipelines. images.py: image classification; text.py: tokenised, packed text for causal LMs;
tokenizer.py: a local BPE tokenizer; order.py: the global sample order; synth.py: demo data."""


class DataError(ValueError):
    """Data that cannot be read. The message names the file or folder and what to do."""


def expand_files(patterns: list[str], key: str) -> list[str]:
    """Files named by `patterns` (paths or globs), in order; a pattern that matches nothing names config `key`."""
    import glob
    from pathlib import Path

    files = []
    for pattern in patterns:
        matched = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
        missing = [f for f in matched if not Path(f).is_file()]
        if not matched or missing:
            raise DataError(f"{key}: {missing[0] if missing else pattern} matches no file")
        files += matched
    return files
