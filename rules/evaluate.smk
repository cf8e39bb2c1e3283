rule evaluate:
    input:
        drafter_upstream("train"),
        lambda wc: [ancient(keyed("vllm", wc.drafter))] if engine_evaluates(wc.drafter) else [],
    output:
        metrics=directory("models/{drafter}/evaluate/{key}"),
        sidecar="models/{drafter}/evaluate/{key}.json",
    log:
        "logs/evaluate/{drafter}/{key}.log",
    benchmark:
        "logs/evaluate/{drafter}/{key}.benchmark.tsv"
    threads: 2
    resources:
        mem_mb=6000,
        gpu=lambda wc: evaluate_gpus(wc.drafter),
    params:
        eaglet=EAGLET,
        file=PARAMS_FILE,
    conda:
        "../envs/eaglet.yaml"
    shell:
        "{params.eaglet} evaluate {wildcards.drafter} --params {params.file:q} "
        "--out {output.metrics:q} --key {wildcards.key} --threads {threads} --quiet "
        "> {log:q} 2>&1"

