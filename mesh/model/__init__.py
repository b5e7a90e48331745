"""The model as stage 0 knows it: where its layer package comes from (`--model`, the embedded
default, the Hub) and its text: the tokenizer and chat template from the GGUF's metadata.

May import: common, config, packages, stage (the modules DESIGN.md §1 lists). Nothing else of mesh/.
"""
