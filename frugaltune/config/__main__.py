"""`python -m frugaltune.config [params.yaml]`: check a params file against the schema before any compute
(frugaltune.config.loading.main; `make pipeline` and `make schedule` run it before `dvc repro`)."""

from frugaltune.config.loading import main

if __name__ == "__main__":
    main()
