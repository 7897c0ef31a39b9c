.PHONY: bootstrap serve test
bootstrap:
	@scripts/bootstrap.sh

serve: bootstrap
	.venv/bin/specdecode serve

test: bootstrap
	.venv/bin/python -P -m pytest $(PYTEST_ARGS)
