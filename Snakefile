# eaglet: prompts -> responses -> hidden states -> drafter -> evaluation, per dataset.
# params.yaml is the one source of truth; every output sits at a content-keyed path.
#   snakemake --cores 2                      # build everything params.yaml defines
#   snakemake --config params=other.yaml -n  # plan another params file


include: "rules/common.smk"
include: "rules/prompts.smk"
include: "rules/responses.smk"
include: "rules/hidden.smk"
include: "rules/vocab.smk"
include: "rules/train.smk"
include: "rules/evaluate.smk"
include: "rules/export.smk"


rule all:
    input:
        [keyed("hidden", ds) for ds in DATASETS],
        [keyed(stage, d) for d in PARAMS.drafters for stage in ("evaluate", "sglang", "vllm")],
    default_target: True


onsuccess:
    shell(f"{EAGLET} publish --params {PARAMS_FILE} > /dev/null")
