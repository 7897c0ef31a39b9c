.PHONY: bootstrap up serve test
bootstrap:
	@scripts/bootstrap.sh

up: bootstrap
	.venv/bin/specdecode up examples/smollm2-ngram.yaml $(UP_ARGS)

serve: bootstrap
	.venv/bin/specdecode serve

test: bootstrap
	.venv/bin/python -P -m pytest $(PYTEST_ARGS)
