rule vocab:
    input:
        drafter_upstream(),
    output:
        vocab="models/{drafter}/vocab/{key}.safetensors",
        sidecar="models/{drafter}/vocab/{key}.json",
    log:
        "logs/vocab/{drafter}/{key}.log",
    threads: 1
    resources:
        mem_mb=4000,
    params:
        eaglet=EAGLET,
        file=PARAMS_FILE,
    conda:
        "../envs/eaglet.yaml"
    shell:
        "{params.eaglet} vocab {wildcards.drafter} --params {params.file:q} "
        "--out {output.vocab:q} --key {wildcards.key} > {log:q} 2>&1"
