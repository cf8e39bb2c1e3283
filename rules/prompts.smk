rule prompts:
    input:
        raw=lambda wc: ancient(PARAMS.resolve(PARAMS.dataset(wc.dataset)["path"])),
    output:
        records="data/prompts/{dataset}/{key}.jsonl.zst",
        sidecar="data/prompts/{dataset}/{key}.json",
    log:
        "logs/prompts/{dataset}/{key}.log",
    threads: 1
    resources:
        mem_mb=2000,
    params:
        eaglet=EAGLET,
        file=PARAMS_FILE,
    conda:
        "../envs/eaglet.yaml"
    shell:
        "{params.eaglet} prompts {wildcards.dataset} --params {params.file:q} "
        "--out {output.records:q} --key {wildcards.key} > {log:q} 2>&1"
