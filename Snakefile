# eaglet: prompts -> responses -> hidden states -> drafter -> evaluation, per dataset.
# params.yaml is the one source of truth; every output sits at a content-keyed path.
#   snakemake --cores 2                      # build everything params.yaml defines
# `all` names every keyed artifact: one deleted is rebuilt alone (its consumers read it ancient);
# an evaluation waits, with a warning, until its held-out suite files are there
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
        wanted(),
    default_target: True


onsuccess:
    shell(f"{EAGLET} publish --params {PARAMS_FILE} > /dev/null")
