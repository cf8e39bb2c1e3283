# eaglet: prompts -> responses -> hidden states -> drafter -> evaluation, per dataset.
# params.yaml is the one source of truth; every output sits at a content-keyed path.
#   snakemake --cores 2                      # build everything params.yaml defines
# `all` names every keyed artifact: one deleted is rebuilt alone (its consumers read it ancient)
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
        [keyed(stage, ds) for ds in DATASETS for stage in DATASET_STAGES],
        [keyed(stage, d) for d in PARAMS.drafters for stage in DRAFTER_STAGES],
    default_target: True


onsuccess:
    shell(f"{EAGLET} publish --params {PARAMS_FILE} > /dev/null")
