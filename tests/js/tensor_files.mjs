// Batches in, state out, for the parity tests (tests/integration/test_js_parity.py writes and reads these).
// Runs in Node and in the browser: `read(file)` gives the bytes of a file next to batches.json.
const ARRAYS = { float32: Float32Array, float64: Float64Array, int64: BigInt64Array, int32: Int32Array,
  uint8: Uint8Array, int8: Int8Array, bool: Uint8Array };

// batches.json: {"steps": [{feed: {"dtype", "shape", "file"}}], "hyper": {name: [value per step]}}
export async function readBatches(ort, read) {
  const spec = JSON.parse(new TextDecoder().decode(await read('batches.json')));
  const steps = [];
  for (const step of spec.steps) {
    const feeds = {};
    for (const [name, t] of Object.entries(step)) {
      const bytes = await read(t.file);
      const data = new ARRAYS[t.dtype](bytes.buffer, bytes.byteOffset, bytes.byteLength / ARRAYS[t.dtype].BYTES_PER_ELEMENT);
      feeds[name] = new ort.Tensor(t.dtype, data.slice(), t.shape);
    }
    steps.push(feeds);
  }
  const hyper = Object.fromEntries(Object.entries(spec.hyper ?? {}).map(([k, v]) => [k, (step) => v[step]]));
  return { steps, hyper };
}

function base64(bytes) {
  let s = '';
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(s);
}

// {name: {"dtype", "shape", "base64"}} for a state keyed by name: JSON-safe, so it leaves a browser page
export function encodeState(state) {
  return Object.fromEntries(Object.entries(state).map(([name, t]) => [name, { dtype: t.type, shape: t.dims,
    base64: base64(new Uint8Array(t.data.buffer, t.data.byteOffset, t.data.byteLength)) }]));
}
