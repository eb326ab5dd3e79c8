// Package clientcompat holds no code, only tests: it checks the library's
// middleware against the retry logic of real third-party HTTP clients,
// go-retryablehttp and stripe-go, on a real Redis, so that what the README
// says about those clients is what they do.
//
// The tests show which of the middleware's answers each client retries and
// how long it waits (Retry-After on 503, 409 while the original runs), that
// a retry carries the key the first attempt carried so that a reply lost
// after the server acted runs the operation once and gets the stored answer,
// that a request without a key runs twice under the same fault, and that
// concurrent duplicates across two instances behind lossy links still run
// once per key.
//
// They also show what stripe-go and the official Stripe Node SDK
// (stripe-node, run by node from node/, whose package-lock.json pins it;
// install it with npm ci there) make of each of the middleware's error
// answers, in the default problem+json and with StripeErrors: which they
// surface as errors, of which class, and which they retry.
//
// It is a module of its own, so that the library's go.mod never requires
// these clients.
package clientcompat
