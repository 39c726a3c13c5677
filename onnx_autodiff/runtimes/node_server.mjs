// node node_server.mjs NODE_MODULES: onnxruntime-node behind a pipe, for onnx_autodiff/runtimes/node.py.
// NODE_MODULES: the node_modules folder that holds onnxruntime-node. One JSON request per line on stdin, one JSON
// answer per line on stdout, in order:
//   {"id", "load": PATH}                 -> {"id", "session", "inputs": [names], "outputs": [names]}
//   {"id", "run": SESSION, "feeds": {}}  -> {"id", "outputs": {name: tensor}}
//   {"id", "close": SESSION}             -> {"id"}
// A tensor is {"dtype": numpy's name, "shape": [..], "data": base64 of its little-endian bytes}. A failure answers
// {"id", "error": the message onnxruntime-node gave}.
import { createRequire } from 'node:module';
import { dirname, join } from 'node:path';
import { createInterface } from 'node:readline';

const modules = process.argv[2];
const ort = createRequire(join(dirname(modules), 'onnx-autodiff-runner.js'))('onnxruntime-node');

const ARRAYS = { float32: Float32Array, float64: Float64Array, int64: BigInt64Array, int32: Int32Array,
  int16: Int16Array, int8: Int8Array, uint8: Uint8Array, uint16: Uint16Array, uint32: Uint32Array,
  uint64: BigUint64Array, bool: Uint8Array, float16: Uint16Array };

function tensor(t) {
  const bytes = Buffer.from(t.data, 'base64');
  const Array_ = ARRAYS[t.dtype];
  if (!Array_) throw new Error(`no onnxruntime-node tensor type for numpy dtype ${t.dtype}`);
  const copy = new Uint8Array(bytes.byteLength);
  copy.set(bytes);
  return new ort.Tensor(t.dtype, new Array_(copy.buffer, 0, copy.byteLength / Array_.BYTES_PER_ELEMENT), t.shape);
}

function plain(t) {
  const data = t.data;
  return { dtype: t.type, shape: t.dims, data: Buffer.from(data.buffer, data.byteOffset, data.byteLength).toString('base64') };
}

const sessions = new Map();
let next = 0;

async function answer(request) {
  if ('load' in request) {
    const session = await ort.InferenceSession.create(request.load, { executionProviders: ['cpu'] });
    sessions.set(++next, session);
    return { session: next, inputs: session.inputNames, outputs: session.outputNames };
  }
  if ('run' in request) {
    const session = sessions.get(request.run);
    const feeds = Object.fromEntries(Object.entries(request.feeds).map(([k, t]) => [k, tensor(t)]));
    const out = await session.run(feeds);
    return { outputs: Object.fromEntries(Object.entries(out).map(([k, t]) => [k, plain(t)])) };
  }
  if ('close' in request) {
    await sessions.get(request.close)?.release();
    sessions.delete(request.close);
    return {};
  }
  throw new Error(`unknown request ${JSON.stringify(Object.keys(request))}`);
}

for await (const line of createInterface({ input: process.stdin })) {
  if (!line.trim()) continue;
  const request = JSON.parse(line);
  let reply;
  try {
    reply = { id: request.id, ...(await answer(request)) };
  } catch (e) {
    reply = { id: request.id, error: String(e?.message ?? e) };
  }
  process.stdout.write(`${JSON.stringify(reply)}\n`);
}
