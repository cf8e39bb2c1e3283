# `train.processes` above 1 runs DDP under torchrun on one node, one process per GPU.
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
        gpu=lambda wc: gpus(*placement(wc.drafter, "train")),
    params:
        eaglet=lambda wc: launcher(placement(wc.drafter, "train")[1]),
        file=PARAMS_FILE,
    conda:
        "../envs/eaglet.yaml"
    shell:
        "{params.eaglet} train {wildcards.drafter} --params {params.file:q} "
        "--out {output.model:q} --key {wildcards.key} --threads {threads} --quiet "
        "> {log:q} 2>&1"
