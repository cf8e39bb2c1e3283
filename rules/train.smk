# One process here; for several GPUs run `torchrun --nproc-per-node N -m eaglet train DRAFTER`.
rule train:
    input:
        drafter_upstream("vocab"),
    output:
        model=directory("models/{drafter}/train/{key}"),
        sidecar="models/{drafter}/train/{key}.json",
    log:
        "logs/train/{drafter}/{key}.log",
    benchmark:
        "logs/train/{drafter}/{key}.benchmark.tsv"
    threads: 2
    resources:
        mem_mb=8000,
        gpu=lambda wc: gpus(PARAMS.drafter(wc.drafter)["train"]["device"]),
    params:
        eaglet=EAGLET,
        file=PARAMS_FILE,
    conda:
        "../envs/eaglet.yaml"
    shell:
        "{params.eaglet} train {wildcards.drafter} --params {params.file:q} "
        "--out {output.model:q} --key {wildcards.key} --threads {threads} --quiet "
        "> {log:q} 2>&1"
