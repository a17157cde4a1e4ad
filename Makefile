.PHONY: test bench bench-quick demo

test:
	bash scripts/test.sh

demo:
	bash scripts/demo.sh

bench:  ## the full benchmark suite (CPU: ~8 min); writes docs/performance.json
	.venv/bin/python -m benchmarks --out docs/performance.json

bench-quick:
	.venv/bin/python -m benchmarks --quick --out /tmp/sdc-bench-quick.json
