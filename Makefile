.PHONY: demo test test-long lint ramdisk bench-ironic
demo:
	bash scripts/demo.sh
test:
	bash scripts/test.sh
test-long:
	BC_LONG=1 bash scripts/test.sh
lint:
	bash -c 'source scripts/bootstrap.sh && "$${UV[@]}" run ruff check . && "$${UV[@]}" run ruff format --check . && "$${UV[@]}" run mypy && "$${UV[@]}" run lint-imports'
ramdisk:
	bash -c 'source scripts/bootstrap.sh && "$${UV[@]}" run bcx ramdisk build'
bench-ironic:
	bash -c 'source scripts/bootstrap.sh && "$${UV[@]}" run --group bench python bench/peers/bench_ironic.py --machines $${N:-10}'
