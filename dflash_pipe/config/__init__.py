"""The parts' config sections, low in the house so that every layer above can read them: the drafter's
shape (``drafter``, with its ``presets``, its MASK token choice ``mask_token`` and the RoPE check ``rope``)
and the training hyper-parameters (``train``). They import only the field metadata; ``run.config`` joins
them with the data, layout and wire sections into the one ``RunConfig``. Import the submodules directly
(nothing is re-exported here, so importing one section loads no other)."""
