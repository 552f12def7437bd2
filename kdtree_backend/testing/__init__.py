"""Test and benchmark support shared by the GPU tests and bench/: the float64 reference, random
verify batches, and the SGLang scene (a real TritonAttnBackend driven through forward_extend).

Never imported by the serving path.
"""
