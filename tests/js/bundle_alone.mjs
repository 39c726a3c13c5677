// A step bundle trained from bundle.json alone, as a user's JavaScript would: stock onnxruntime-node or
// onnxruntime-web (the `ort` namespace passed in) and this loop, nothing of onnx-autodiff (not web/train.js).
// docs/runtimes.md's loop: run init.onnx, then per batch feed the batch, the state, the hyper-parameters and the
// host scalars (computed from the step counter in the state) and carry the state (bundle.json's `state` map).
// `read(file)`: the bytes of a file of the bundle folder. Returns { losses, state }.
const ARRAYS = { float32: Float32Array, float64: Float64Array, int32: Int32Array, int64: BigInt64Array };

function hostScalar(ort, spec, state) {
  const t = Number(state[spec.counter].data[0]) + spec.offset;
  const value = spec.factors ? spec.factors.reduce((v, [beta, power]) => v * (1 - beta ** t) ** power, 1) : t;
  return new ort.Tensor(spec.dtype, ARRAYS[spec.dtype].of(spec.dtype === 'int64' ? BigInt(value) : value), []);
}

export async function trainAlone(ort, read, batches, sessionOptions = {}) {
  const manifest = JSON.parse(new TextDecoder().decode(await read('bundle.json')));
  if (manifest.format !== 'onnx-autodiff-step/2') throw new Error(`unknown bundle format ${manifest.format}`);
  // one session at a time (onnxruntime-web's WebGPU refuses a session while it makes another)
  const init = await ort.InferenceSession.create(await read(manifest.init), sessionOptions);
  const initial = await init.run({});
  let state = Object.fromEntries(Object.keys(manifest.state).map((name) => [name, initial[name]]));
  const step = await ort.InferenceSession.create(await read(manifest.step), sessionOptions);
  const hyper = Object.fromEntries(Object.entries(manifest.hyper).map(
    ([name, v]) => [name, new ort.Tensor('float32', Float32Array.of(v), [])]));
  const losses = [];
  for (const batch of batches) {
    const scalars = Object.fromEntries(Object.entries(manifest.host_scalars ?? {}).map(
      ([name, spec]) => [name, hostScalar(ort, spec, state)]));
    const out = await step.run({ ...batch, ...state, ...hyper, ...scalars });
    state = Object.fromEntries(Object.entries(manifest.state).map(([input, output]) => [input, out[output]]));
    losses.push(Number(out[manifest.loss].data[0]));
  }
  return { losses, state };
}
