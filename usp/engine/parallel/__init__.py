"""Everything that turns a model into a parallel one: the device mesh (mesh.py), one file per
parallelism (data, tensor, context, expert, pipeline), activation recomputation, FSDP2 mixed
precision, applied in one fixed order by parallelize.py; build.py builds what one rank trains."""
