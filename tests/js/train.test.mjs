// node --test: onnx_autodiff/web/train.js on onnxruntime-node. The bundles come from
// tests/integration/test_js_driver.py (it sets ONNX_AUTODIFF_TEST_BUNDLES and runs this file); run alone, it skips.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'node:test';
import * as ort from 'onnxruntime-node';
import { openBundle, runStep, train } from '../../onnx_autodiff/web/train.js';

const root = process.env.ONNX_AUTODIFF_TEST_BUNDLES;
const skip = root ? false : 'ONNX_AUTODIFF_TEST_BUNDLES is not set (run tests/integration/test_js_driver.py)';
const bundle = (name) => join(root, name);

function mlpBatch(seed) {  // x [8, 16], labels [8] in 0..4, from a small LCG
  let s = seed;
  const next = () => ((s = (s * 1103515245 + 12345) % 2147483648) / 2147483648);
  const x = Float32Array.from({ length: 8 * 16 }, () => next() * 2 - 1);
  const labels = BigInt64Array.from({ length: 8 }, () => BigInt(Math.floor(next() * 5)));
  return { x: new ort.Tensor('float32', x, [8, 16]), labels: new ort.Tensor('int64', labels, [8]) };
}

test('trains a bundle with a learning-rate schedule and hands back the state', { skip }, async () => {
  const spec = JSON.parse(readFileSync(join(bundle('mlp'), 'bundle.json'), 'utf8'));
  const seen = [];
  const schedule = (step) => { seen.push(step); return 0.05 / (1 + step); };
  const batch = mlpBatch(1);
  const { state, losses } = await train(ort, bundle('mlp'), Array(20).fill(batch), { hyper: { learning_rate: schedule } });
  assert.deepEqual(seen, [...Array(20).keys()]);
  assert.equal(losses.length, 20);
  assert.ok(losses[19] < 0.5 * losses[0], `the loss on one repeated batch fell from ${losses[0]} to only ${losses[19]}`);
  assert.deepEqual(Object.keys(state).sort(), Object.keys(spec.state).sort());
  const init = await (await openBundle(ort, bundle('mlp'))).init.run({});
  for (const name of Object.keys(spec.state).filter((n) => n.startsWith('W'))) {
    assert.notDeepEqual(Array.from(state[name].data), Array.from(init[name].data), `${name} did not change`);
  }
});

test('a state name the step model does not take fails loudly', { skip }, async () => {
  await assert.rejects(train(ort, bundle('wrong-name'), [mlpBatch(2)]),
    /state input\(s\) W1_renamed of bundle\.json are not among the step session's inputNames/);
});

test("onnxruntime-node's inputNames leave out inputs with an initializer default: the driver says so", { skip }, async () => {
  const raw = await ort.InferenceSession.create(join(bundle('defaults'), 'step.onnx'));
  assert.ok(!raw.inputNames.includes('W1'), 'onnxruntime-node now lists inputs with defaults: update docs/runtimes.md');
  await assert.rejects(train(ort, bundle('defaults'), [mlpBatch(3)]),
    /state input\(s\) .*W1.* are not among the step session's inputNames/);
});

test('a step that gives back the state it was fed, at a nonzero learning rate, fails loudly', { skip }, async () => {
  const x = new ort.Tensor('float32', Float32Array.of(1, 2, 3, 4), [2, 2]);
  await assert.rejects(train(ort, bundle('frozen'), [{ x }]), /every state tensor equal to what was fed/);
  const { losses } = await train(ort, bundle('frozen'), [{ x }], { hyper: { learning_rate: 0 } });
  assert.equal(losses.length, 1);  // at learning rate 0 an unchanged state is what a step should give
});

test('a step input nothing feeds, or a feed no input takes, fails loudly', { skip }, async () => {
  const b = await openBundle(ort, bundle('mlp'));
  const state = await b.init.run({});
  const { x } = mlpBatch(4);
  await assert.rejects(runStep(b, state, { x }), /nothing fed for step input\(s\) labels/);
  const { labels } = mlpBatch(4);
  await assert.rejects(runStep(b, state, { x, labels, label: labels }), /label fed, but the step takes no such input/);
});

test('a bundle of another format version is refused', { skip }, async () => {
  await assert.rejects(openBundle(ort, bundle('format-2')),
    /has format "onnx-autodiff-step\/3"; this driver reads onnx-autodiff-step\/2 and \/1/);
});

test('a bundle that names a file outside its folder is refused before anything is read', { skip }, async () => {
  await assert.rejects(openBundle(ort, bundle('outside')),
    /bundle.json's step is "..\/mlp\/step.onnx", a file outside the bundle's folder/);
});

test("a decoder's bundle trains from token ids and a mask: bundle.json's made gives the KV cache and positions", { skip }, async () => {
  const want = JSON.parse(readFileSync(join(bundle('decoder'), 'expected.json'), 'utf8'));
  const tensor = (rows) => new ort.Tensor('int64', BigInt64Array.from(rows.flat(), BigInt), [rows.length, rows[0].length]);
  const batch = { input_ids: tensor(want.input_ids), attention_mask: tensor(want.attention_mask) };
  const { losses } = await train(ort, bundle('decoder'), Array(3).fill(batch));
  losses.forEach((loss, i) => assert.ok(Math.abs(loss - want.losses[i]) <= 1e-5 * Math.abs(want.losses[i]),
    `step ${i}: loss ${loss}, TrainingSession's ${want.losses[i]}`));
});
