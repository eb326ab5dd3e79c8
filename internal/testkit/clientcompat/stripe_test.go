package clientcompat_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/testkit/faultproxy"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// refunds is POST /v1/refunds as Stripe answers it, on l: it reads the form
// stripe-go sends and answers 200 with the refund object.
func refunds(l *ledger) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := r.ParseForm(); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		amount, err := strconv.ParseInt(r.PostForm.Get("amount"), 10, 64)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		n := l.charge(r)
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]any{
			"id": fmt.Sprintf("re_%d", n), "object": "refund", "amount": amount,
			"charge": r.PostForm.Get("charge"), "currency": "usd", "status": "succeeded",
		})
	})
}

// newStripeClient returns a stripe-go client of the API at baseURL that
// retries up to maxRetries times, quiet, on fresh connections.
func newStripeClient(baseURL string, maxRetries int64) *stripe.Client {
	return stripe.NewClient("sk_test_clientcompat", stripe.WithBackends(stripe.NewBackendsWithConfig(&stripe.BackendConfig{
		HTTPClient:        freshConnections(),
		LeveledLogger:     &stripe.LeveledLogger{Level: stripe.LevelNull},
		MaxNetworkRetries: stripe.Int64(maxRetries),
		URL:               stripe.String(baseURL),
	})))
}

// refundParams is a refund of 500 of charge ch_paid, under key when it is
// not "" (otherwise stripe-go makes one).
func refundParams(key string) *stripe.RefundCreateParams {
	p := &stripe.RefundCreateParams{Charge: stripe.String("ch_paid"), Amount: stripe.Int64(500)}
	if key != "" {
		p.SetIdempotencyKey(key)
	}
	return p
}

// stripe-go makes an Idempotency-Key for a POST by itself and sends it, with
// the same form body, on its retry after a reply lost once the server acted:
// the refund runs once and stripe-go gets it, replayed.
func TestStripeGoLostReply(t *testing.T) {
	r := testserver.StartRedis(t)
	l := newLedger()
	var arr arrivals
	srv := serve(t, arr.wrap(newGuard(t, r.Addr, idempotency.Options{}).Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant})(refunds(l))))
	link := faultproxy.Start(t, srv.Listener.Addr().String())
	sc := newStripeClient("http://"+link.Addr(), stripe.DefaultMaxNetworkRetries)

	// On a loaded machine the proxy may miss its moment (the whole exchange
	// goes through): then the refund ran once, unreplayed, and the case is
	// tried again under a new key until the reply is lost.
	var refund *stripe.Refund
	var got []arrival
	for try := 1; ; try++ {
		before := len(arr.all())
		link.ResetOnNextRequest(true)
		var err error
		refund, err = sc.V1Refunds.Create(context.Background(), refundParams(""))
		require.NoError(t, err)
		got = arr.all()[before:]
		if len(got) > 1 || try == 5 {
			break
		}
		t.Logf("try %d: the reply was not lost", try)
	}
	assert.Equal(t, fmt.Sprintf("re_%d", l.made()), refund.ID)
	assert.EqualValues(t, 500, refund.Amount)
	assert.Equal(t, "ch_paid", refund.Charge.ID)
	assert.Equal(t, "true", refund.LastResponse.Header.Get("Idempotent-Replayed"))

	require.Len(t, got, 2)
	assert.NotEmpty(t, got[0].key)
	assert.Equal(t, got[0], got[1], "the retry is the same request")
	assert.Equal(t, "application/x-www-form-urlencoded", got[0].contentType)
	form, err := url.ParseQuery(got[0].body)
	require.NoError(t, err)
	assert.Equal(t, url.Values{"amount": {"500"}, "charge": {"ch_paid"}}, form)
	assert.Equal(t, 1, l.ran(got[0].key))
}

// firstOutcome closes seen when the first event with its outcome is
// observed.
type firstOutcome struct {
	want idempotency.Outcome
	seen chan struct{}
	once sync.Once
}

func (f *firstOutcome) Observe(_ context.Context, e idempotency.Event) {
	if e.Kind == idempotency.EventOutcome && e.Outcome == f.want {
		f.once.Do(func() { close(f.seen) })
	}
}

// stripe-go retries the middleware's 409 (the original still in flight),
// whose problem+json body is no Stripe error object, and its retry gets the
// original's refund, replayed.
func TestStripeGoRetriesInFlightConflict(t *testing.T) {
	r := testserver.StartRedis(t)
	l := newLedger()
	conflict := &firstOutcome{want: idempotency.OutcomeInFlight, seen: make(chan struct{})}
	started := make(chan struct{})
	l.afterCharge = func(*http.Request) {
		close(started) // a second execution panics
		select {
		case <-conflict.seen:
		case <-time.After(10 * time.Second): // only a hang: the assertions fail
		}
	}
	mw := idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant}
	a := serve(t, newGuard(t, r.Addr, idempotency.Options{}).Middleware(mw)(refunds(l)))
	var arr arrivals
	// b's duplicates do not wait for the original: they get 409 at once.
	b := serve(t, arr.wrap(newGuard(t, r.Addr, idempotency.Options{WaitTimeout: -1, Observer: conflict}).Middleware(mw)(refunds(l))))

	type result struct {
		refund *stripe.Refund
		err    error
	}
	original := make(chan result, 1)
	go func() {
		refund, err := newStripeClient(a.URL, 0).V1Refunds.Create(context.Background(), refundParams("order-7-refund"))
		original <- result{refund, err}
	}()
	<-started

	dup, err := newStripeClient(b.URL, 5).V1Refunds.Create(context.Background(), refundParams("order-7-refund"))
	require.NoError(t, err)
	first := <-original
	require.NoError(t, first.err)
	assert.Equal(t, "re_1", first.refund.ID)
	assert.Empty(t, first.refund.LastResponse.Header.Get("Idempotent-Replayed"))
	assert.Equal(t, "re_1", dup.ID)
	assert.Equal(t, "true", dup.LastResponse.Header.Get("Idempotent-Replayed"))
	assert.Equal(t, 1, l.ran("order-7-refund"))
	got := arr.all()
	assert.GreaterOrEqual(t, len(got), 2, "the 409 and at least one retry")
	for _, g := range got {
		assert.Equal(t, "order-7-refund", g.key)
	}
}

// stripe-go's own key lasts one call: a second Create with the same
// parameters, as an application might make after stripe-go gave up, is a
// second refund. A key of the application's, kept across its calls, makes
// the second call a replay.
func TestStripeGoKeyIsPerCall(t *testing.T) {
	r := testserver.StartRedis(t)
	l := newLedger()
	var arr arrivals
	srv := serve(t, arr.wrap(newGuard(t, r.Addr, idempotency.Options{}).Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant})(refunds(l))))
	sc := newStripeClient(srv.URL, 0)
	create := func(key string) *stripe.Refund {
		refund, err := sc.V1Refunds.Create(context.Background(), refundParams(key))
		require.NoError(t, err)
		return refund
	}

	assert.Equal(t, "re_1", create("").ID)
	assert.Equal(t, "re_2", create("").ID)
	assert.Equal(t, "re_3", create("order-9-refund").ID)
	again := create("order-9-refund")
	assert.Equal(t, "re_3", again.ID)
	assert.Equal(t, "true", again.LastResponse.Header.Get("Idempotent-Replayed"))

	got := arr.all()
	require.Len(t, got, 4)
	assert.NotEmpty(t, got[0].key)
	assert.NotEmpty(t, got[1].key)
	assert.NotEqual(t, got[0].key, got[1].key)
	assert.Equal(t, "order-9-refund", got[2].key)
	assert.Equal(t, "order-9-refund", got[3].key)
	assert.Equal(t, 3, l.made())
}
