package clientcompat_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/idempotency-go/idempotency"
)

// The keys under which an errorAPI answers an error of its own, and the
// request body it accepts.
const (
	keyReused = "order-reused" // used again, after a refund, with another amount
	keyHeld   = "order-held"   // its refund stays in the handler until release
	keyBig    = "order-big"    // sent with a body over errorAPIMaxBody
	keyDown   = "order-down"   // the store cannot claim it
	// errorAPIMaxBody is an errorAPI's MaxRequestBytes: a refund of the tests
	// is well under it, one with a note of this many bytes over it.
	errorAPIMaxBody = 256
)

// errorAPI is POST /v1/refunds (refunds, on a ledger of its own) behind the
// middleware on a memory store, with its errors written by one
// MiddlewareOptions.Errors, set up so that one request under each key above
// gets one of the middleware's errors:
//
//	keyReused  key-reused 422 (400 with StripeErrors), once a refund ran under it
//	keyHeld    in-flight 409 at once (WaitTimeout -1), while the first refund under it waits for release
//	keyBig     body-too-large 413 (400 with StripeErrors), with a body over errorAPIMaxBody
//	keyDown    store-unavailable 503: the store's Claim fails with ErrUnavailable
//
// For the stripe-node script, which cannot see the test's channels, GET
// /test/held answers once the held refund is in its handler and GET
// /test/release lets it go on; both are outside the middleware and not
// counted in arr.
type errorAPI struct {
	srv     *httptest.Server
	l       *ledger
	arr     arrivals      // the requests to /v1/refunds
	held    chan struct{} // closed when the refund under keyHeld is in its handler
	release func()        // lets it go on; idempotent
}

// unavailableFor is a store that cannot claim the key named name: its Claim
// fails with ErrUnavailable, as a store that cannot be reached does.
type unavailableFor struct {
	idempotency.Store
	name string
}

func (s unavailableFor) Claim(ctx context.Context, req idempotency.ClaimRequest) (idempotency.Claim, error) {
	if req.Key.Name == s.name {
		return idempotency.Claim{}, fmt.Errorf("clientcompat: store down: %w", idempotency.ErrUnavailable)
	}
	return s.Store.Claim(ctx, req)
}

// newErrorAPI starts an errorAPI whose errors format writes, closed when t
// ends.
func newErrorAPI(t *testing.T, format func(http.ResponseWriter, *http.Request, idempotency.Problem)) *errorAPI {
	t.Helper()
	a := &errorAPI{l: newLedger(), held: make(chan struct{})}
	released := make(chan struct{})
	var once sync.Once
	a.release = func() { once.Do(func() { close(released) }) }
	a.l.afterCharge = func(r *http.Request) {
		if r.Header.Get("Idempotency-Key") == keyHeld {
			close(a.held) // a second execution panics
			<-released
		}
	}
	store := unavailableFor{Store: idempotency.NewMemoryStore(idempotency.MemoryOptions{}), name: keyDown}
	guard := idempotency.New(store, idempotency.Options{WaitTimeout: -1})
	mw := guard.Middleware(idempotency.MiddlewareOptions{
		Scope: idempotency.SingleTenant, MaxRequestBytes: errorAPIMaxBody, Errors: format,
	})
	mux := http.NewServeMux()
	mux.Handle("POST /v1/refunds", a.arr.wrap(mw(refunds(a.l))))
	mux.HandleFunc("GET /test/held", func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-a.held:
			w.WriteHeader(http.StatusNoContent)
		case <-r.Context().Done():
		}
	})
	mux.HandleFunc("GET /test/release", func(w http.ResponseWriter, _ *http.Request) {
		a.release()
		w.WriteHeader(http.StatusNoContent)
	})
	a.srv = serve(t, mux)
	// Cleanups run last-registered first: the held refund goes on before
	// the server's Close, which waits for it.
	t.Cleanup(a.release)
	return a
}

// count reports how many requests under key reached the server.
func (a *arrivals) count(key string) int {
	n := 0
	for _, g := range a.all() {
		if g.key == key {
			n++
		}
	}
	return n
}

// waitHeld waits until the refund under keyHeld is in its handler.
func (a *errorAPI) waitHeld(t *testing.T) {
	t.Helper()
	select {
	case <-a.held:
	case <-time.After(10 * time.Second): // only a hang: the test fails
		t.Fatal("the refund under keyHeld never reached its handler")
	}
}

// stripeGoErrorCase makes, on a, the stripe-go call that gets the error of
// the case code (a Problem.Code: key-reused, in-flight, body-too-large,
// store-unavailable) from a stripe-go client that retries up to
// stripe.DefaultMaxNetworkRetries times, and returns that call's error and
// the number of its requests that reached the server. It checks that the
// refund ran only where it should: once under keyReused and keyHeld (the
// first call, which succeeds), never under the others.
func stripeGoErrorCase(t *testing.T, a *errorAPI, code string) (error, int) {
	t.Helper()
	ctx := context.Background()
	sc := newStripeClient(a.srv.URL, stripe.DefaultMaxNetworkRetries)
	var err error
	var n int
	switch code {
	case "key-reused":
		first, err0 := sc.V1Refunds.Create(ctx, refundParams(keyReused))
		require.NoError(t, err0)
		assert.Equal(t, "re_1", first.ID)
		p := refundParams(keyReused)
		p.Amount = stripe.Int64(600)
		_, err = sc.V1Refunds.Create(ctx, p)
		n = a.arr.count(keyReused) - 1
		assert.Equal(t, 1, a.l.ran(keyReused))
	case "in-flight":
		original := make(chan error, 1)
		go func() {
			_, err := newStripeClient(a.srv.URL, 0).V1Refunds.Create(ctx, refundParams(keyHeld))
			original <- err
		}()
		a.waitHeld(t)
		_, err = sc.V1Refunds.Create(ctx, refundParams(keyHeld))
		n = a.arr.count(keyHeld) - 1
		a.release()
		require.NoError(t, <-original, "the original refund")
		assert.Equal(t, 1, a.l.ran(keyHeld))
	case "body-too-large":
		p := refundParams(keyBig)
		p.AddMetadata("note", strings.Repeat("x", errorAPIMaxBody))
		_, err = sc.V1Refunds.Create(ctx, p)
		n = a.arr.count(keyBig)
		assert.Equal(t, 0, a.l.ran(keyBig))
	case "store-unavailable":
		_, err = sc.V1Refunds.Create(ctx, refundParams(keyDown))
		n = a.arr.count(keyDown)
		assert.Equal(t, 0, a.l.ran(keyDown))
	default:
		t.Fatalf("no case %q", code)
	}
	require.Error(t, err, "stripe-go must not take the %s answer for a refund", code)
	return err, n
}

// With Errors: idempotency.StripeErrors, stripe-go returns each of the
// middleware's errors as a *stripe.Error with the answer's status, type and
// code, and the typed error of that type (IdempotencyError,
// InvalidRequestError, APIError) in its Err. It sends each of these calls
// once: stripe-go v82 retries no answer that parses as a Stripe error
// (Error.canRetry allows only a 429 lock_timeout) and reads
// Stripe-Should-Retry only for answers that do not, so the 409 and the 503,
// although they say Stripe-Should-Retry: true, reach the application at
// once, unretried, where with problem+json they are retried
// (TestStripeGoProblemDetails).
func TestStripeGoStripeErrors(t *testing.T) {
	for _, c := range []struct {
		code        string
		status      int
		typ         stripe.ErrorType
		typed       error // the type of stripe.Error.Err
		shouldRetry string
	}{
		{"key-reused", http.StatusBadRequest, stripe.ErrorTypeIdempotency, &stripe.IdempotencyError{}, "false"},
		{"in-flight", http.StatusConflict, stripe.ErrorTypeIdempotency, &stripe.IdempotencyError{}, "true"},
		{"body-too-large", http.StatusBadRequest, stripe.ErrorTypeInvalidRequest, &stripe.InvalidRequestError{}, "false"},
		{"store-unavailable", http.StatusServiceUnavailable, stripe.ErrorTypeAPI, &stripe.APIError{}, "true"},
	} {
		t.Run(c.code, func(t *testing.T) {
			t.Parallel()
			a := newErrorAPI(t, idempotency.StripeErrors)
			err, n := stripeGoErrorCase(t, a, c.code)

			var se *stripe.Error
			require.ErrorAs(t, err, &se)
			assert.Equal(t, c.status, se.HTTPStatusCode)
			assert.Equal(t, c.typ, se.Type)
			assert.EqualValues(t, c.code, se.Code)
			assert.Equal(t, idempotency.ProblemTypes+c.code, se.DocURL)
			assert.NotEmpty(t, se.Msg)
			assert.IsType(t, c.typed, se.Err)
			require.NotNil(t, se.LastResponse)
			assert.Equal(t, c.shouldRetry, se.LastResponse.Header.Get("Stripe-Should-Retry"))
			assert.Equal(t, 1, n, "requests of the failing call: stripe-go retries no Stripe error")
		})
	}
}

// problemStatuses are the errors an errorAPI answers, by code, with the
// status the default ProblemDetails sends.
var problemStatuses = []struct {
	code   string
	status int
}{
	{"key-reused", http.StatusUnprocessableEntity},
	{"in-flight", http.StatusConflict},
	{"body-too-large", http.StatusRequestEntityTooLarge},
	{"store-unavailable", http.StatusServiceUnavailable},
}

// With the default problem+json, stripe-go still returns each error as an
// error, never as a refund, but as a plain error whose text is the
// problem+json body: no *stripe.Error, so no status, type or code for the
// application to read but by parsing that text. And it retries every one,
// up to MaxNetworkRetries: a body it cannot read as a Stripe error is to
// stripe-go a failure of the connection's kind, retried whatever the status,
// so the 422 and 413, which a retry cannot mend, are sent 1 +
// MaxNetworkRetries times too.
func TestStripeGoProblemDetails(t *testing.T) {
	for _, c := range problemStatuses {
		t.Run(c.code, func(t *testing.T) {
			t.Parallel()
			a := newErrorAPI(t, idempotency.ProblemDetails)
			err, n := stripeGoErrorCase(t, a, c.code)

			var se *stripe.Error
			assert.False(t, errors.As(err, &se), "no *stripe.Error: %#v", err)
			var p idempotency.Problem
			require.NoError(t, json.Unmarshal([]byte(err.Error()), &p), "the error's text is the body: %q", err)
			assert.Equal(t, c.status, p.Status)
			assert.Equal(t, c.code, p.Code)
			assert.Equal(t, 1+int(stripe.DefaultMaxNetworkRetries), n, "requests of the failing call")
		})
	}
}
