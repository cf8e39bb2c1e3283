rule export:
    input:
        lambda wc: ancient(keyed("train", wc.drafter)),
    output:
        folder=directory("models/{drafter}/{fmt}/{key}"),
        sidecar="models/{drafter}/{fmt}/{key}.json",
    log:
        "logs/{fmt}/{drafter}/{key}.log",
    threads: 1
    resources:
        mem_mb=4000,
    params:
        eaglet=EAGLET,
        file=PARAMS_FILE,
    conda:
        "../envs/eaglet.yaml"
    shell:
        "{params.eaglet} export {wildcards.drafter} --to {wildcards.fmt} "
        "--params {params.file:q} --out {output.folder:q} --key {wildcards.key} > {log:q} 2>&1"
