rule hidden:
    input:
        responses=upstream("responses"),
    output:
        states=directory("data/hidden/{dataset}/{key}"),
        sidecar="data/hidden/{dataset}/{key}.json",
    log:
        "logs/hidden/{dataset}/{key}.log",
    benchmark:
        "logs/hidden/{dataset}/{key}.benchmark.tsv"
    threads: 2
    resources:
        mem_mb=6000,
        gpu=gpus(PARAMS.data["hidden"]["device"]),
    params:
        eaglet=EAGLET,
        file=PARAMS_FILE,
    conda:
        "../envs/eaglet.yaml"
    shell:
        "{params.eaglet} hidden {wildcards.dataset} --params {params.file:q} "
        "--out {output.states:q} --key {wildcards.key} --threads {threads} --quiet "
        "> {log:q} 2>&1"
