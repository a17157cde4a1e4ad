.PHONY: test bench bench-ddp bench-fsdp2 bench-quick demo

test:
	bash scripts/test.sh

demo:
	bash scripts/demo.sh

bench:  ## the full benchmark suite (CPU: ~8 min); writes benchmarks/results/performance.json and benchmarks/results/performance-fsdp2.json
	.venv/bin/python -m benchmarks --out benchmarks/results/performance.json
	PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 4 -m benchmarks.fsdp2_lightning --out benchmarks/results/performance-fsdp2.json
	.venv/bin/python -m benchmarks.report

bench-fsdp2:  ## only the FSDP2 section (4 CPU ranks, ~2 min); re-renders the page
	PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 4 -m benchmarks.fsdp2_lightning --out benchmarks/results/performance-fsdp2.json
	.venv/bin/python -m benchmarks.report

bench-ddp:  ## only the Lightning and Accelerate DDP sections and the traffic (CPU: ~6 min); re-renders the page
	.venv/bin/python -m benchmarks --sections ddp,accelerate,traffic --out benchmarks/results/performance.json
	.venv/bin/python -m benchmarks.report

bench-quick:
	.venv/bin/python -m benchmarks --quick --out /tmp/sdc-bench-quick.json
