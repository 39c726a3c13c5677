"""Checking code in one folder (``tests/check/`` mirrors it): ``gradcheck.py`` (finite differences and the
forward mode against our gradients, on any runtime of ``runtimes/``), ``input_dims.py`` (sizes of a model's
symbolic input dims its graph allows), ``llm_files.py`` (the language-model files people hold: feeds and the
float reference of quantized ops), ``contrib_forms.py`` and ``quantized_gather.py`` (standard-ONNX forms of
onnxruntime's contrib ops and of GatherBlockQuantized, the float64 reference ``check`` runs them through).
The public names are ``onnx_autodiff.gradcheck``, ``jvp_check`` and ``GradcheckReport``."""
