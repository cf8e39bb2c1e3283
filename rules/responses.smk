rule responses:
    input:
        prompts=upstream("prompts"),
    output:
        records="data/responses/{dataset}/{key}.jsonl.zst",
        sidecar="data/responses/{dataset}/{key}.json",
    log:
        "logs/responses/{dataset}/{key}.log",
    benchmark:
        "logs/responses/{dataset}/{key}.benchmark.tsv"
    # a server's client needs one core; `--resources api=N` caps runs against remote APIs
    threads: lambda wc: 1 if remote_backend(wc.dataset) else 2
    resources:
        mem_mb=4000,
        api=lambda wc: int(remote_backend(wc.dataset)),
    params:
        eaglet=EAGLET,
        file=PARAMS_FILE,
    conda:
        "../envs/eaglet.yaml"
    shell:
        "{params.eaglet} generate {wildcards.dataset} --params {params.file:q} "
        "--out {output.records:q} --key {wildcards.key} --threads {threads} --quiet "
        "> {log:q} 2>&1"
