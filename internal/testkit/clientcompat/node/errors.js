'use strict';
// Run by TestStripeNodeErrors (../stripe_node_test.go) as
//
//   node errors.js PORT MAX_NETWORK_RETRIES
//
// against that test's errorAPI on 127.0.0.1:PORT. It makes, with stripe-node,
// the refunds that get each of the middleware's errors, and prints one JSON
// line per call with what stripe-node gave the application: the error it
// threw (its class, status, code, the body's error.type) or the object it
// resolved with (its id, if it has one, and its fields).

const Stripe = require('stripe');

const port = Number(process.argv[2]);
const maxNetworkRetries = Number(process.argv[3]);
const stripe = new Stripe('sk_test_clientcompat', {
  host: '127.0.0.1',
  port,
  protocol: 'http',
  maxNetworkRetries,
});

// The keys of ../stripe_errors_test.go's errorAPI.
const keyReused = 'order-reused';
const keyHeld = 'order-held';
const keyBig = 'order-big';
const keyDown = 'order-down';
const maxBody = 256; // errorAPIMaxBody: a note this long is over it

function refund(key, params = {}) {
  return stripe.refunds.create(
    {charge: 'ch_paid', amount: 500, ...params},
    {idempotencyKey: key},
  );
}

// outcome settles call and describes what the application got from it.
async function outcome(name, call) {
  try {
    const obj = await call;
    return {
      case: name,
      threw: false,
      id: obj.id ?? null,
      status: obj.lastResponse?.statusCode ?? null,
      object: obj,
    };
  } catch (err) {
    return {
      case: name,
      threw: true,
      class: err.constructor.name,
      type: err.type ?? null,
      rawType: err.rawType ?? null,
      status: err.statusCode ?? null,
      code: err.code ?? null,
      shouldRetry: err.headers?.['stripe-should-retry'] ?? null,
      message: err.message,
    };
  }
}

// test calls one of the errorAPI's endpoints outside the middleware.
async function test(path) {
  const res = await fetch(`http://127.0.0.1:${port}/test/${path}`);
  if (res.status !== 204) {
    throw new Error(`GET /test/${path}: ${res.status}`);
  }
}

async function keyReusedCase() {
  const first = await outcome('key-reused-first', refund(keyReused));
  const again = await outcome('key-reused', refund(keyReused, {amount: 600}));
  return [first, again];
}

async function inFlightCase() {
  const original = outcome('in-flight-original', refund(keyHeld));
  await test('held');
  const dup = await outcome('in-flight', refund(keyHeld));
  await test('release');
  return [await original, dup];
}

async function main() {
  const results = await Promise.all([
    keyReusedCase(),
    inFlightCase(),
    outcome('body-too-large', refund(keyBig, {metadata: {note: 'x'.repeat(maxBody)}})),
    outcome('store-unavailable', refund(keyDown)),
  ]);
  const lines = results.flat().map((r) => JSON.stringify(r) + '\n');
  // Exit once written: the keep-alive connections of stripe-node's agent
  // and of fetch would hold the process open.
  process.stdout.write(lines.join(''), () => process.exit(0));
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
