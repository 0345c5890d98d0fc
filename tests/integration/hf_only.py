"""Run in a fresh interpreter by the export tests: load an exported folder with transformers alone (behemoth
made unimportable) and print what it computes as one JSON line.

    python hf_only.py images EXPORT_DIR IMAGE_FILES_JSON   -> {"labels": [...], "processor": ...}
    python hf_only.py lm EXPORT_DIR VAL_BLOCKS_NPY TEXT     -> {"val_loss", "ids", "generated"}
    python hf_only.py text_classification EXPORT_DIR TEXTS_JSON -> {"labels": [...], "scores": [...]}
"""

import json
import sys

sys.modules["behemoth"] = None  # `import behemoth` raises ImportError: nothing below may need it
sys.path = [p for p in sys.path if not p.rstrip("/").endswith("platform")]


def images(folder: str, files_json: str) -> dict:
    from transformers import pipeline

    classify = pipeline("image-classification", model=folder)
    files = json.loads(open(files_json).read())
    return {"labels": [p[0]["label"] for p in classify(files, top_k=1, batch_size=32)],
            "processor": type(classify.image_processor).__name__}


def lm(folder: str, blocks_npy: str, text: str) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    blocks = torch.from_numpy(np.load(blocks_npy).astype(np.int64))
    with torch.no_grad():
        total = sum(model(input_ids=b[None], labels=b[None]).loss.double() for b in blocks)
        prompt = tokenizer(text.split(".")[0], return_tensors="pt")
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return {"val_loss": float(total / len(blocks)), "ids": tokenizer(text)["input_ids"],
            "generated": tokenizer.decode(out[0][prompt["input_ids"].shape[1]:], skip_special_tokens=True)}


def text_classification(folder: str, texts_json: str) -> dict:
    from transformers import pipeline

    classify = pipeline("text-classification", model=folder)
    got = [classify(text, truncation=True)[0] for text in json.loads(open(texts_json).read())]
    return {"labels": [g["label"] for g in got], "scores": [g["score"] for g in got]}


if __name__ == "__main__":
    tasks = {"images": images, "lm": lm, "text_classification": text_classification}
    print(json.dumps(tasks[sys.argv[1]](*sys.argv[2:])))
