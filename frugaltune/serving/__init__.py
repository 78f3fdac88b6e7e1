"""Serve a fine-tuned model: load base model + adapter, predict; the MLflow pyfunc models that carry it.

Not run directly. The register stage logs `pyfunc.SequenceClassifierModel` with one artifact, the adapter dir (which
also holds the tokenizer and `labels.json`), and a reference to the base model: its sha256 and the MLflow URI where
`base.log_base_model` stored it once, in the experiment `[internal] frugaltune base models`, whatever the number of
versions trained on it (a version that copied the 538 MB base would grow the store by that much per retraining).
Loading resolves the base from a local cache (`~/.cache/frugaltune/bases/<sha256>`, or `FRUGALTUNE_BASE_CACHE`), else
downloads it from the tracking store once and checks its hash. The model also carries the sha256 of the adapter's
files and of the base's config.json (`files.model_files`); loading hashes them again and refuses a damaged file in
one line (`files.verify_model_files`). Anyone can then predict with

    mlflow.pyfunc.load_model("models:/frugaltune-sentiment@champion").predict(pd.DataFrame({"text": [...]}))

or from the shell with `frugaltune predict "some text"`.

A prompt -> response model (train task `causal_lm`; labels.json says so) is logged as `pyfunc.GenerativeModel`
instead:

    model.predict(pd.DataFrame({"prompt": ["What is 2+2?"]}))                              # -> ["4"]
    model.predict(pd.DataFrame({"prompt": ["2+2?"], "candidates": [["4", "5"]]}))          # the likeliest candidate
    model.predict(df, params={"max_new_tokens": 16, "temperature": 0.7})

Its rooms, each importing only those listed before it: `files` (labels.json, the files' hashes and their check),
`base` (the base model stored once and found again), `classifier` (`load_classifier`), `generator`
(`load_generator`), `pyfunc` (the two pyfunc models, `log_model`).

This package must import nothing from the rest of the project but `frugaltune.generation`, `frugaltune.classify` (the
one classification evaluator, which the evaluate stage and the federation score with too) and
`frugaltune.input_template` (which import nothing from it either): `pyfunc.log_model` pickles the package and those
three by value into the logged model, so a registered version loads with MLflow, torch, transformers and peft
alone, and keeps working after these files change (no logged version names a class path here: every one, since the
first, was pickled by value).
"""

from frugaltune.serving.classifier import load_classifier
from frugaltune.serving.generator import load_generator

__all__ = ["load_classifier", "load_generator"]
