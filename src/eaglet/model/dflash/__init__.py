"""DFlash (z-lab, arXiv 2602.06036): a block drafter beside the EAGLE-3 one (eaglet.model.drafter).

config.py (sizes and DFlash's choices), model.py (the forward), loss.py (anchors, blocks, the
decayed cross-entropy), train.py (the fit); the folder vLLM and SGLang load is
eaglet.formats.dflash_export."""
