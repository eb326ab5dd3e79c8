package idempotencyotel_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"go.opentelemetry.io/otel/sdk/metric/metricdata/metricdatatest"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idempotency-go/idempotency"
	idempotencyotel "github.com/idempotency-go/idempotency/otel"
)

// scope is every test key's scope: a tenant id, which no metric may carry.
const scope = "acct_tenant_4711"

var (
	fp      = idempotency.FingerprintOf("charge", []byte(`{"amount":1}`))
	otherFP = idempotency.FingerprintOf("charge", []byte(`{"amount":2}`))
	bounds  = []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}
)

func ok201(context.Context) (idempotency.Response, error) {
	return idempotency.Response{Status: 201, Body: []byte(`{"id":"ch_1"}`)}, nil
}

// pipeline is an Observer wired to an SDK that the test reads back, and a
// tee that keeps the events the Guard reported, in the order the Observer
// handled them (so that the i-th outcome is the i-th span).
type pipeline struct {
	obs    *idempotencyotel.Observer
	reader *sdkmetric.ManualReader
	spans  *tracetest.SpanRecorder
	tp     *sdktrace.TracerProvider

	mu     sync.Mutex
	events []idempotency.Event
}

func newPipeline(t *testing.T) *pipeline {
	t.Helper()
	p := &pipeline{reader: sdkmetric.NewManualReader(), spans: tracetest.NewSpanRecorder()}
	p.tp = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(p.spans))
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(p.reader))
	t.Cleanup(func() {
		_ = p.tp.Shutdown(context.Background())
		_ = mp.Shutdown(context.Background())
	})
	var err error
	p.obs, err = idempotencyotel.NewObserver(idempotencyotel.Options{MeterProvider: mp, TracerProvider: p.tp})
	require.NoError(t, err)
	return p
}

// Observe passes e to the Observer under test, then keeps it.
func (p *pipeline) Observe(ctx context.Context, e idempotency.Event) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.obs.Observe(ctx, e)
	p.events = append(p.events, e)
}

func (p *pipeline) eventsOf(kind idempotency.EventKind) []idempotency.Event {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []idempotency.Event
	for _, e := range p.events {
		if e.Kind == kind {
			out = append(out, e)
		}
	}
	return out
}

// parent starts the span that stands for the request's (otelhttp's).
func (p *pipeline) parent() (context.Context, trace.Span) {
	return p.tp.Tracer("test").Start(context.Background(), "request")
}

// collect returns the metrics of the library's scope, by name, and checks
// that no other scope reported any.
func (p *pipeline) collect(t *testing.T) map[string]metricdata.Metrics {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, p.reader.Collect(context.Background(), &rm))
	out := map[string]metricdata.Metrics{}
	for _, sm := range rm.ScopeMetrics {
		require.Equal(t, "github.com/idempotency-go/idempotency", sm.Scope.Name)
		require.Equal(t, "https://opentelemetry.io/schemas/1.43.0", sm.Scope.SchemaURL)
		for _, m := range sm.Metrics {
			out[m.Name] = m
		}
	}
	return out
}

// calls returns the idempotency.call spans, in the order they ended.
func (p *pipeline) calls() []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range p.spans.Ended() {
		if s.Name() == "idempotency.call" {
			out = append(out, s)
		}
	}
	return out
}

// point is one expected data point: its attributes and its value (a
// counter's sum, or a histogram's count).
type point struct {
	attrs []attribute.KeyValue
	value int64
}

func set(kv ...attribute.KeyValue) *attribute.Set { s := attribute.NewSet(kv...); return &s }

// enc renders an attribute set for comparisons that print well.
func enc(kv ...attribute.KeyValue) string { return set(kv...).Encoded(attribute.DefaultEncoder()) }

// assertCounter asserts that got is a cumulative monotonic Int64 sum with
// the unit and exactly the data points want.
func assertCounter(t *testing.T, got metricdata.Metrics, unit string, want ...point) {
	t.Helper()
	assert.NotEmpty(t, got.Description, got.Name)
	var dps []metricdata.DataPoint[int64]
	for _, w := range want {
		dps = append(dps, metricdata.DataPoint[int64]{Attributes: *set(w.attrs...), Value: w.value})
	}
	exp := metricdata.Metrics{Name: got.Name, Description: got.Description, Unit: unit, Data: metricdata.Sum[int64]{
		Temporality: metricdata.CumulativeTemporality, IsMonotonic: true, DataPoints: dps}}
	metricdatatest.AssertEqual(t, exp, got, metricdatatest.IgnoreTimestamp(), metricdatatest.IgnoreExemplars())
}

// assertHistogram asserts that got is a Float64 histogram in seconds, with
// the advised bounds, and exactly the data points want (value: the count);
// it returns the points' sums by encoded attribute set (see enc).
func assertHistogram(t *testing.T, got metricdata.Metrics, want ...point) map[string]float64 {
	t.Helper()
	assert.NotEmpty(t, got.Description, got.Name)
	assert.Equal(t, "s", got.Unit, got.Name)
	h, ok := got.Data.(metricdata.Histogram[float64])
	require.True(t, ok, "%s is a %T, want a float64 histogram", got.Name, got.Data)
	assert.Equal(t, metricdata.CumulativeTemporality, h.Temporality)
	wantCount := map[string]uint64{}
	for _, w := range want {
		wantCount[enc(w.attrs...)] = uint64(w.value)
	}
	gotCount := map[string]uint64{}
	sums := map[string]float64{}
	for _, dp := range h.DataPoints {
		k := dp.Attributes.Encoded(attribute.DefaultEncoder())
		gotCount[k] = dp.Count
		sums[k] = dp.Sum
		assert.Equal(t, bounds, dp.Bounds, got.Name)
	}
	assert.Equal(t, wantCount, gotCount, got.Name)
	return sums
}

var (
	executed  = attribute.String("idempotency.outcome", "executed")
	replayed  = attribute.String("idempotency.outcome", "replayed")
	mismatch  = attribute.String("idempotency.outcome", "mismatch")
	waitedRep = attribute.String("idempotency.outcome", "waited_replayed")
	post      = attribute.String("http.request.method", "POST")
	route     = attribute.String("http.route", "/v1/charges")
)

func attempt(n int) attribute.KeyValue { return attribute.Int("idempotency.attempt", n) }
func errType(s string) attribute.KeyValue {
	return attribute.String("error.type", s)
}
func storeOp(s string) attribute.KeyValue {
	return attribute.String("idempotency.store.operation", s)
}

// claimDead leaves k in flight under an owner that stopped: its lease of
// 10ms has run out when claimDead returns.
func claimDead(t *testing.T, ctx context.Context, s idempotency.Store, k idempotency.Key) {
	t.Helper()
	c, err := s.Claim(ctx, idempotency.ClaimRequest{Key: k, Fingerprint: fp, OperationID: "op-dead",
		Lease: 10 * time.Millisecond, Retention: time.Hour})
	require.NoError(t, err)
	require.Equal(t, idempotency.Owner, c.State)
	time.Sleep(20 * time.Millisecond)
}

// runCalls drives the calls the package's doc promises to report, through
// the library, in ctx: executed, replayed, mismatch, a middleware request,
// a wait, a takeover, a renewal and a sweep. It returns the key names used.
func runCalls(t *testing.T, ctx context.Context, obs idempotency.Observer) []string {
	t.Helper()
	store := idempotency.NewMemoryStore(idempotency.MemoryOptions{})
	guard := idempotency.New(store, idempotency.Options{Observer: obs})
	key := func(name string) idempotency.Key { return idempotency.Key{Scope: scope, Name: name} }

	// 1-3: executed, replayed, mismatch.
	res, err := guard.Do(ctx, key("key-exec-9f2c"), fp, ok201)
	require.NoError(t, err)
	require.False(t, res.Replayed)
	res, err = guard.Do(ctx, key("key-exec-9f2c"), fp, ok201)
	require.NoError(t, err)
	require.True(t, res.Replayed)
	_, err = guard.Do(ctx, key("key-exec-9f2c"), otherFP, ok201)
	require.ErrorIs(t, err, idempotency.ErrMismatch)

	// 4: the middleware under a ServeMux pattern.
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges", guard.Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant})(http.HandlerFunc(
		func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusCreated)
			_, _ = io.WriteString(w, `{"id":"ch_2"}`)
		})))
	req := httptest.NewRequestWithContext(ctx, http.MethodPost, "/v1/charges", strings.NewReader(`{"amount":1}`))
	req.Header.Set(idempotency.HeaderKey, "key-http-51ab")
	w := httptest.NewRecorder()
	mux.ServeHTTP(w, req)
	require.Equal(t, http.StatusCreated, w.Code)

	// 5-6: an owner held back, and a duplicate that waits for it.
	started, release, ownerDone := make(chan struct{}), make(chan struct{}), make(chan error, 1)
	go func() {
		_, err := guard.Do(ctx, key("key-wait-07de"), fp, func(context.Context) (idempotency.Response, error) {
			close(started)
			<-release
			return ok201(ctx)
		})
		ownerDone <- err
	}()
	<-started
	waiterDone := make(chan idempotency.Result, 1)
	go func() {
		res, err := guard.Do(ctx, key("key-wait-07de"), fp, ok201)
		assert.NoError(t, err)
		waiterDone <- res
	}()
	time.Sleep(100 * time.Millisecond) // the duplicate is waiting by now
	close(release)
	require.NoError(t, <-ownerDone)
	require.True(t, (<-waiterDone).Replayed)

	// 7: a takeover from an owner whose lease ran out, without Recover.
	claimDead(t, ctx, store, key("key-dead-c3e1"))
	_, err = guard.Do(ctx, key("key-dead-c3e1"), fp, ok201)
	require.NoError(t, err)

	// 8: an operation that outlasts a third of its lease: one renewal.
	renewing := idempotency.New(store, idempotency.Options{Observer: obs, Lease: 300 * time.Millisecond})
	_, err = renewing.Do(ctx, key("key-slow-88b0"), fp, func(context.Context) (idempotency.Response, error) {
		time.Sleep(150 * time.Millisecond)
		return ok201(ctx)
	})
	require.NoError(t, err)

	// A sweep that settles one abandoned record through Recover.
	swept := idempotency.NewMemoryStore(idempotency.MemoryOptions{})
	claimDead(t, ctx, swept, key("key-swept-4d6f"))
	sweeper := idempotency.New(swept, idempotency.Options{Observer: obs,
		Recover: func(context.Context) (idempotency.Response, error) { return idempotency.Response{Status: 201}, nil }})
	n, err := sweeper.Sweep(ctx, 10)
	require.NoError(t, err)
	require.Equal(t, 1, n)

	return []string{"key-exec-9f2c", "key-http-51ab", "key-wait-07de", "key-dead-c3e1", "key-slow-88b0", "key-swept-4d6f"}
}

func TestObserverRecordsRealCalls(t *testing.T) {
	p := newPipeline(t)
	ctx, parent := p.parent()
	runCalls(t, ctx, p)
	parent.End()

	ms := p.collect(t)
	assert.ElementsMatch(t, []string{"idempotency.outcomes", "idempotency.call.duration", "idempotency.wait.duration",
		"idempotency.renewals", "idempotency.renewal.duration", "idempotency.takeovers", "idempotency.sweep.records",
		"idempotency.sweeps"}, keys(ms))

	// Four executed by Do (first call, the held-back owner, the takeover,
	// the renewed one), one by the middleware.
	outcomes := []point{
		{[]attribute.KeyValue{executed}, 4},
		{[]attribute.KeyValue{replayed}, 1},
		{[]attribute.KeyValue{mismatch, errType("mismatch")}, 1},
		{[]attribute.KeyValue{executed, post, route}, 1},
		{[]attribute.KeyValue{waitedRep}, 1},
	}
	assertCounter(t, ms["idempotency.outcomes"], "{call}", outcomes...)
	durSums := assertHistogram(t, ms["idempotency.call.duration"], outcomes...)
	assert.Greater(t, durSums[enc(executed)], 0.15+0.1, "the renewed call slept 150ms, the held-back one 100ms")
	waitSums := assertHistogram(t, ms["idempotency.wait.duration"], point{[]attribute.KeyValue{waitedRep}, 1})
	waited := p.eventsOf(idempotency.EventOutcome)
	var wantWait float64
	for _, e := range waited {
		wantWait += e.Waited.Seconds()
	}
	assert.InDelta(t, wantWait, waitSums[enc(waitedRep)], 1e-9)
	assert.Greater(t, wantWait, 0.05)

	confirmed := attribute.String("idempotency.renewal.result", "confirmed")
	assertCounter(t, ms["idempotency.renewals"], "{renewal}", point{[]attribute.KeyValue{confirmed}, 1})
	assertHistogram(t, ms["idempotency.renewal.duration"], point{[]attribute.KeyValue{confirmed}, 1})
	abandoned := attribute.String("idempotency.takeover.previous", "abandoned")
	assertCounter(t, ms["idempotency.takeovers"], "{takeover}", point{[]attribute.KeyValue{abandoned}, 1})
	assertCounter(t, ms["idempotency.sweep.records"], "{record}",
		point{[]attribute.KeyValue{attribute.String("idempotency.sweep.result", "found")}, 1},
		point{[]attribute.KeyValue{attribute.String("idempotency.sweep.result", "settled")}, 1},
		point{[]attribute.KeyValue{attribute.String("idempotency.sweep.result", "left")}, 0})
	assertCounter(t, ms["idempotency.sweeps"], "{sweep}", point{nil, 1})

	// One span per outcome, in the order the events came.
	events := p.eventsOf(idempotency.EventOutcome)
	spans := p.calls()
	require.Len(t, events, 8)
	require.Len(t, spans, 8)
	want := [][]attribute.KeyValue{
		{executed, attempt(1)},
		{replayed},
		{mismatch, errType("mismatch")},
		{executed, post, route, attempt(1)},
		{executed, attempt(1)}, // the held-back owner
		{waitedRep, attribute.Float64("idempotency.wait.duration", 0)},
		{executed, attempt(2)},
		{executed, attempt(1)},
	}
	if events[4].Outcome == idempotency.OutcomeWaitedReplayed {
		want[4], want[5] = want[5], want[4] // the waiter reported first
	}
	for i, s := range spans {
		e := events[i]
		w := want[i]
		if e.Waited > 0 {
			w = append([]attribute.KeyValue{}, w...)
			w[len(w)-1] = attribute.Float64("idempotency.wait.duration", e.Waited.Seconds())
		}
		assert.Equal(t, trace.SpanKindInternal, s.SpanKind(), i)
		assert.Equal(t, parent.SpanContext().TraceID(), s.SpanContext().TraceID(), i)
		assert.Equal(t, parent.SpanContext().SpanID(), s.Parent().SpanID(), i)
		assert.Equal(t, e.Duration, s.EndTime().Sub(s.StartTime()), i)
		assert.Equal(t, enc(w...), enc(s.Attributes()...), "span %d (%v)", i, e.Outcome)
		assert.Equal(t, sdktrace.Status{Code: codes.Unset}, s.Status(), i)
		assert.Empty(t, s.Events(), i)
		assert.Equal(t, "github.com/idempotency-go/idempotency", s.InstrumentationScope().Name)
	}

	// The middleware's count has an exemplar from its span.
	sum := ms["idempotency.outcomes"].Data.(metricdata.Sum[int64])
	var found bool
	for _, dp := range sum.DataPoints {
		if dp.Attributes.Equals(set(executed, post, route)) {
			found = true
			require.Len(t, dp.Exemplars, 1)
			assert.Equal(t, spans[3].SpanContext().SpanID(), trace.SpanID(dp.Exemplars[0].SpanID))
			assert.Equal(t, parent.SpanContext().TraceID(), trace.TraceID(dp.Exemplars[0].TraceID))
		}
	}
	assert.True(t, found)

	// The takeover, the renewal and the sweep are events of the request's span.
	var req sdktrace.ReadOnlySpan
	for _, s := range p.spans.Ended() {
		if s.Name() == "request" {
			req = s
		}
	}
	require.NotNil(t, req)
	renewal, sweep := p.eventsOf(idempotency.EventRenewal), p.eventsOf(idempotency.EventSweep)
	require.Len(t, renewal, 1)
	require.Len(t, sweep, 1)
	type ev struct {
		name  string
		attrs string
	}
	var got []ev
	for _, e := range req.Events() {
		got = append(got, ev{e.Name, enc(e.Attributes...)})
	}
	assert.Equal(t, []ev{
		{"idempotency.takeover", enc(abandoned, attempt(2))},
		{"idempotency.renewal", enc(confirmed, attempt(1),
			attribute.Float64("idempotency.renewal.duration", renewal[0].Duration.Seconds()))},
		{"idempotency.sweep", enc(attribute.Int("idempotency.sweep.found", 1), attribute.Int("idempotency.sweep.settled", 1),
			attribute.Int("idempotency.sweep.left", 0),
			attribute.Float64("idempotency.sweep.duration", sweep[0].Duration.Seconds()))},
	}, got)
}

// faultyStore is a MemoryStore whose Claim, Heartbeat or Abandoned fail
// with the error set for them.
type faultyStore struct {
	*idempotency.MemoryStore
	claim, heartbeat, abandoned error
}

func (s faultyStore) Claim(ctx context.Context, req idempotency.ClaimRequest) (idempotency.Claim, error) {
	if s.claim != nil {
		return idempotency.Claim{}, s.claim
	}
	return s.MemoryStore.Claim(ctx, req)
}

func (s faultyStore) Heartbeat(ctx context.Context, k idempotency.Key, token uint64, lease time.Duration) error {
	if s.heartbeat != nil {
		return s.heartbeat
	}
	return s.MemoryStore.Heartbeat(ctx, k, token, lease)
}

func (s faultyStore) ListAbandoned(ctx context.Context, limit int) ([]idempotency.AbandonedRecord, error) {
	if s.abandoned != nil {
		return nil, s.abandoned
	}
	return s.MemoryStore.ListAbandoned(ctx, limit)
}

var (
	errClaim = fmt.Errorf("%w: claim: connection refused", idempotency.ErrUnavailable)
	errList  = fmt.Errorf("%w: abandoned: connection refused", idempotency.ErrUnavailable)
	errRenew = fmt.Errorf("%w: renew", idempotency.ErrFenced)
)

// runFailures drives, through the library, calls that end in errors: the
// store down for a claim (unavailable, and failed open through the
// middleware), a refused renewal (fenced), a Recover that cannot tell
// (recovery_unknown), an operation's own error (released, then taken over),
// an invalid key, and a sweep that cannot list. It returns the key names.
func runFailures(t *testing.T, ctx context.Context, obs idempotency.Observer) []string {
	t.Helper()
	key := func(name string) idempotency.Key { return idempotency.Key{Scope: scope, Name: name} }

	// 1: unavailable.
	down := idempotency.New(faultyStore{MemoryStore: idempotency.NewMemoryStore(idempotency.MemoryOptions{}), claim: errClaim,
		abandoned: errList}, idempotency.Options{Observer: obs,
		Recover: func(context.Context) (idempotency.Response, error) { return idempotency.Response{}, nil }})
	_, err := down.Do(ctx, key("key-down-2b7e"), fp, ok201)
	require.ErrorIs(t, err, idempotency.ErrUnavailable)

	// 2: failed open.
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges", down.Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant, FailOpen: true})(http.HandlerFunc(
		func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) })))
	req := httptest.NewRequestWithContext(ctx, http.MethodPost, "/v1/charges", strings.NewReader(`{"amount":1}`))
	req.Header.Set(idempotency.HeaderKey, "key-open-61fa")
	w := httptest.NewRecorder()
	mux.ServeHTTP(w, req)
	require.Equal(t, http.StatusCreated, w.Code)

	// 3: fenced, by a refused renewal.
	refusing := idempotency.New(faultyStore{MemoryStore: idempotency.NewMemoryStore(idempotency.MemoryOptions{}),
		heartbeat: errRenew}, idempotency.Options{Observer: obs, Lease: 300 * time.Millisecond})
	_, err = refusing.Do(ctx, key("key-fenced-0c9d"), fp, func(ctx context.Context) (idempotency.Response, error) {
		select {
		case <-ctx.Done():
			return idempotency.Response{}, context.Cause(ctx)
		case <-time.After(5 * time.Second):
			return ok201(ctx)
		}
	})
	require.ErrorIs(t, err, idempotency.ErrFenced)

	// 4: recovery_unknown, after a takeover of an abandoned record.
	store := idempotency.NewMemoryStore(idempotency.MemoryOptions{})
	unsure := idempotency.New(store, idempotency.Options{Observer: obs,
		Recover: func(context.Context) (idempotency.Response, error) {
			return idempotency.Response{}, idempotency.ErrUnknown
		}})
	claimDead(t, ctx, store, key("key-unsure-e5a2"))
	_, err = unsure.Do(ctx, key("key-unsure-e5a2"), fp, ok201)
	require.ErrorIs(t, err, idempotency.ErrInFlight)

	// 5-6: the operation's own error releases the record, whose retry
	// takes it over; the error's text names the key, and must go nowhere.
	guard := idempotency.New(store, idempotency.Options{Observer: obs})
	_, err = guard.Do(ctx, key("key-declined-7731"), fp, func(context.Context) (idempotency.Response, error) {
		return idempotency.Response{}, errors.New("card declined for key-declined-7731 in " + scope)
	})
	require.Error(t, err)
	_, err = guard.Do(ctx, key("key-declined-7731"), fp, ok201)
	require.NoError(t, err)

	// 7: an invalid key.
	_, err = guard.Do(ctx, idempotency.Key{Scope: scope}, fp, ok201)
	require.ErrorIs(t, err, idempotency.ErrInvalidKey)

	// A sweep that cannot list.
	_, err = down.Sweep(ctx, 10)
	require.ErrorIs(t, err, idempotency.ErrUnavailable)

	return []string{"key-down-2b7e", "key-open-61fa", "key-fenced-0c9d", "key-unsure-e5a2", "key-declined-7731"}
}

func TestObserverRecordsFailures(t *testing.T) {
	p := newPipeline(t)
	ctx, parent := p.parent()
	runFailures(t, ctx, p)
	// Events the Guard does not make here: an unknown method, and a kind
	// of event this adapter does not know, which it ignores.
	p.Observe(ctx, idempotency.Event{Kind: idempotency.EventOutcome, Outcome: idempotency.OutcomeExecuted,
		Method: "BREW", Route: "/pot", Duration: time.Millisecond})
	p.Observe(ctx, idempotency.Event{Kind: idempotency.EventKind(99), Outcome: idempotency.OutcomeExecuted})
	parent.End()

	out := func(s string) attribute.KeyValue { return attribute.String("idempotency.outcome", s) }
	ms := p.collect(t)
	outcomes := []point{
		{[]attribute.KeyValue{out("unavailable"), storeOp("claim"), errType("unavailable")}, 1},
		{[]attribute.KeyValue{out("failed_open"), post, route, storeOp("claim"), errType("failed_open")}, 1},
		{[]attribute.KeyValue{out("fenced"), errType("fenced")}, 1},
		{[]attribute.KeyValue{out("recovery_unknown"), errType("recovery_unknown")}, 1},
		{[]attribute.KeyValue{out("released"), errType("_OTHER")}, 1},
		{[]attribute.KeyValue{executed}, 1},
		{[]attribute.KeyValue{out("invalid_key"), errType("invalid_key")}, 1},
		{[]attribute.KeyValue{executed, attribute.String("http.request.method", "_OTHER"),
			attribute.String("http.route", "/pot")}, 1},
	}
	assertCounter(t, ms["idempotency.outcomes"], "{call}", outcomes...)
	assertHistogram(t, ms["idempotency.call.duration"], outcomes...)
	assert.NotContains(t, ms, "idempotency.wait.duration")
	failed := []attribute.KeyValue{attribute.String("idempotency.renewal.result", "failed"), errType("fenced")}
	assertCounter(t, ms["idempotency.renewals"], "{renewal}", point{failed, 1})
	assertHistogram(t, ms["idempotency.renewal.duration"], point{failed, 1})
	assertCounter(t, ms["idempotency.takeovers"], "{takeover}",
		point{[]attribute.KeyValue{attribute.String("idempotency.takeover.previous", "abandoned")}, 1},
		point{[]attribute.KeyValue{attribute.String("idempotency.takeover.previous", "released")}, 1})
	assertCounter(t, ms["idempotency.sweeps"], "{sweep}", point{[]attribute.KeyValue{errType("unavailable")}, 1})
	assertCounter(t, ms["idempotency.sweep.records"], "{record}",
		point{[]attribute.KeyValue{attribute.String("idempotency.sweep.result", "found")}, 0},
		point{[]attribute.KeyValue{attribute.String("idempotency.sweep.result", "settled")}, 0},
		point{[]attribute.KeyValue{attribute.String("idempotency.sweep.result", "left")}, 0})

	// The service's failures are errors of their spans, with the error
	// recorded; the application's and the client's are not.
	spans := p.calls()
	events := p.eventsOf(idempotency.EventOutcome)
	require.Len(t, spans, 8)
	require.Len(t, events, 8)
	wantStatus := []string{"unavailable", "failed_open", "fenced", "recovery_unknown", "", "", "", ""}
	for i, s := range spans {
		assert.Equal(t, events[i].Outcome.String(), value(s.Attributes(), "idempotency.outcome").AsString(), i)
		if wantStatus[i] == "" {
			assert.Equal(t, sdktrace.Status{Code: codes.Unset}, s.Status(), i)
			assert.Empty(t, s.Events(), i)
			continue
		}
		assert.Equal(t, sdktrace.Status{Code: codes.Error, Description: wantStatus[i]}, s.Status(), i)
		require.Len(t, s.Events(), 1, i)
		exc := s.Events()[0]
		assert.Equal(t, "exception", exc.Name)
		assert.Equal(t, s.EndTime(), exc.Time)
		assert.Contains(t, exc.Attributes, attribute.String("exception.message", events[i].Err.Error()))
	}

	// The request's span has the failed renewal, both takeovers and the sweep.
	var names []string
	for _, s := range p.spans.Ended() {
		if s.Name() != "request" {
			continue
		}
		for _, e := range s.Events() {
			names = append(names, e.Name)
			if e.Name == "idempotency.sweep" {
				assert.Contains(t, e.Attributes, errType("unavailable"))
				assert.Contains(t, e.Attributes, storeOp("abandoned"))
			}
			if e.Name == "idempotency.renewal" {
				assert.Contains(t, e.Attributes, errType("fenced"))
			}
		}
	}
	assert.Equal(t, []string{"idempotency.renewal", "idempotency.takeover", "idempotency.takeover", "idempotency.sweep"}, names)
}

// TestObserverNeverExportsKeysOrScopes drives every scenario and looks for
// a key's name in every attribute of every span, span event, data point
// and exemplar, and for the scope in every metric attribute.
func TestObserverNeverExportsKeysOrScopes(t *testing.T) {
	p := newPipeline(t)
	ctx, parent := p.parent()
	names := append(runCalls(t, ctx, p), runFailures(t, ctx, p)...)
	parent.End()

	var seen int
	check := func(where string, kvs []attribute.KeyValue, forbidden []string) {
		for _, kv := range kvs {
			seen++
			v := kv.Value.Emit()
			for _, f := range forbidden {
				assert.NotContains(t, v, f, "%s: %s", where, kv.Key)
				assert.NotContains(t, string(kv.Key), f, where)
			}
		}
	}
	for _, s := range p.spans.Ended() {
		check("span "+s.Name(), s.Attributes(), names)
		for _, e := range s.Events() {
			check("event "+e.Name, e.Attributes, names)
		}
	}
	var rm metricdata.ResourceMetrics
	require.NoError(t, p.reader.Collect(context.Background(), &rm))
	forbidden := append([]string{scope}, names...)
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, dp := range d.DataPoints {
					check(m.Name, dp.Attributes.ToSlice(), forbidden)
					for _, x := range dp.Exemplars {
						check(m.Name+" exemplar", x.FilteredAttributes, forbidden)
					}
				}
			case metricdata.Histogram[float64]:
				for _, dp := range d.DataPoints {
					check(m.Name, dp.Attributes.ToSlice(), forbidden)
					for _, x := range dp.Exemplars {
						check(m.Name+" exemplar", x.FilteredAttributes, forbidden)
					}
				}
			default:
				t.Errorf("%s: unexpected %T", m.Name, m.Data)
			}
		}
	}
	assert.Greater(t, seen, 50, "the check looked at attributes")
}

// TestObserverDefaultsToGlobalProviders checks that the zero Options use the
// global providers.
func TestObserverDefaultsToGlobalProviders(t *testing.T) {
	reader, spans := sdkmetric.NewManualReader(), tracetest.NewSpanRecorder()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	prevM, prevT := otel.GetMeterProvider(), otel.GetTracerProvider()
	otel.SetMeterProvider(mp)
	otel.SetTracerProvider(tp)
	t.Cleanup(func() {
		otel.SetMeterProvider(prevM)
		otel.SetTracerProvider(prevT)
	})
	obs, err := idempotencyotel.NewObserver(idempotencyotel.Options{})
	require.NoError(t, err)
	obs.Observe(context.Background(), idempotency.Event{Kind: idempotency.EventOutcome,
		Outcome: idempotency.OutcomeReplayed, Duration: time.Millisecond})
	p := &pipeline{reader: reader, spans: spans}
	assertCounter(t, p.collect(t)["idempotency.outcomes"], "{call}", point{[]attribute.KeyValue{replayed}, 1})
	calls := p.calls()
	require.Len(t, calls, 1)
	assert.False(t, calls[0].Parent().IsValid(), "a call with no span in its context is a root span")
}

// value returns the value of the attribute k of kvs, or an empty Value.
func value(kvs []attribute.KeyValue, k attribute.Key) attribute.Value {
	for _, kv := range kvs {
		if kv.Key == k {
			return kv.Value
		}
	}
	return attribute.Value{}
}

func keys(m map[string]metricdata.Metrics) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// TestObserverTracksInFlight reads a tracked Guard's operations and waiters
// while an owner is held back and a duplicate waits, and after.
func TestObserverTracksInFlight(t *testing.T) {
	p := newPipeline(t)
	guard := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{Observer: p})
	untrack := p.obs.Track(guard)
	untrackAgain := p.obs.Track(guard) // counted once
	ctx := context.Background()
	k := idempotency.Key{Scope: scope, Name: "key-gauge-3a90"}

	upDown := func(m metricdata.Metrics, unit string, n int64) {
		t.Helper()
		assert.Equal(t, unit, m.Unit, m.Name)
		assert.NotEmpty(t, m.Description, m.Name)
		metricdatatest.AssertAggregationsEqual(t, metricdata.Sum[int64]{Temporality: metricdata.CumulativeTemporality,
			IsMonotonic: false, DataPoints: []metricdata.DataPoint[int64]{{Value: n}}}, m.Data,
			metricdatatest.IgnoreTimestamp(), metricdatatest.IgnoreExemplars())
	}
	ms := p.collect(t)
	upDown(ms["idempotency.operation.count"], "{operation}", 0)
	upDown(ms["idempotency.waiter.count"], "{call}", 0)

	started, release, done := make(chan struct{}), make(chan struct{}), make(chan struct{}, 2)
	go func() {
		_, err := guard.Do(ctx, k, fp, func(context.Context) (idempotency.Response, error) {
			close(started)
			<-release
			return ok201(ctx)
		})
		assert.NoError(t, err)
		done <- struct{}{}
	}()
	<-started
	go func() {
		_, err := guard.Do(ctx, k, fp, ok201)
		assert.NoError(t, err)
		done <- struct{}{}
	}()
	require.Eventually(t, func() bool { _, w := guard.InFlight(); return w == 1 }, 5*time.Second, time.Millisecond)
	ms = p.collect(t)
	upDown(ms["idempotency.operation.count"], "{operation}", 1)
	upDown(ms["idempotency.waiter.count"], "{call}", 1)

	close(release)
	<-done
	<-done
	ms = p.collect(t)
	upDown(ms["idempotency.operation.count"], "{operation}", 0)
	upDown(ms["idempotency.waiter.count"], "{call}", 0)

	untrack()
	untrack() // nothing more
	assert.Contains(t, p.collect(t), "idempotency.operation.count", "still tracked once")
	untrackAgain()
	ms = p.collect(t)
	assert.NotContains(t, ms, "idempotency.operation.count")
	assert.NotContains(t, ms, "idempotency.waiter.count")
}

// Given to a Guard as itself, the Observer traces each phase: claim, run
// and settle are children of the call's span, which is a child of the
// request's, and the operation's own spans are children of run. The run
// and settle spans carry the attempt and token, the call's span the
// outcome, and the renewal is an event on the call's span.
func TestObserverPhaseSpans(t *testing.T) {
	p := newPipeline(t)
	g := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}),
		idempotency.Options{Observer: p.obs, Lease: 300 * time.Millisecond})
	ctx, parent := p.tp.Tracer("test").Start(context.Background(), "request")
	_, err := g.Do(ctx, idempotency.Key{Scope: scope, Name: "phases"}, fp, func(ctx context.Context) (idempotency.Response, error) {
		_, own := p.tp.Tracer("test").Start(ctx, "charge the card")
		time.Sleep(150 * time.Millisecond) // one renewal, at 100ms
		own.End()
		return ok201(ctx)
	})
	require.NoError(t, err)
	parent.End()

	byName := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range p.spans.Ended() {
		require.NotContains(t, byName, s.Name(), "two spans named %s", s.Name())
		byName[s.Name()] = s
	}
	for _, name := range []string{"request", "idempotency.call", "idempotency.claim", "idempotency.run", "idempotency.settle", "charge the card"} {
		require.Contains(t, byName, name)
	}
	parentOf := func(name string) string {
		for n, s := range byName {
			if s.SpanContext().SpanID() == byName[name].Parent().SpanID() {
				return n
			}
		}
		return ""
	}
	assert.Equal(t, "request", parentOf("idempotency.call"))
	for _, phase := range []string{"idempotency.claim", "idempotency.run", "idempotency.settle"} {
		assert.Equal(t, "idempotency.call", parentOf(phase), phase)
		assert.Equal(t, trace.SpanKindInternal, byName[phase].SpanKind(), phase)
	}
	assert.Equal(t, "idempotency.run", parentOf("charge the card"))

	attrs := func(name string) map[attribute.Key]attribute.Value {
		out := map[attribute.Key]attribute.Value{}
		for _, kv := range byName[name].Attributes() {
			out[kv.Key] = kv.Value
		}
		return out
	}
	for _, phase := range []string{"idempotency.run", "idempotency.settle"} {
		a := attrs(phase)
		assert.Equal(t, int64(1), a["idempotency.attempt"].AsInt64(), phase)
		assert.Positive(t, a["idempotency.token"].AsInt64(), phase)
	}
	assert.Equal(t, "executed", attrs("idempotency.call")["idempotency.outcome"].AsString())
	call := byName["idempotency.call"]
	assert.False(t, call.EndTime().Before(byName["idempotency.settle"].EndTime()), "the call ends after its settle phase")
	var events []string
	for _, e := range call.Events() {
		events = append(events, e.Name)
	}
	assert.Contains(t, events, "idempotency.renewal")
}

// TrackStore reports a store's Stats as idempotency.store.records, by state,
// at each collection, and nothing once untracked.
func TestObserverTracksStore(t *testing.T) {
	p := newPipeline(t)
	ctx := context.Background()
	store := idempotency.NewMemoryStore(idempotency.MemoryOptions{})
	for i, lease := range []time.Duration{time.Hour, time.Hour, time.Millisecond} {
		_, err := store.Claim(ctx, idempotency.ClaimRequest{Key: idempotency.Key{Name: fmt.Sprint("k", i)}, Fingerprint: fp,
			OperationID: fmt.Sprint("op-", i), Lease: lease, Retention: time.Hour})
		require.NoError(t, err)
	}
	time.Sleep(5 * time.Millisecond)
	untrack := p.obs.TrackStore(store)

	m, ok := p.collect(t)["idempotency.store.records"]
	require.True(t, ok, "idempotency.store.records not reported")
	assert.Equal(t, "{record}", m.Unit)
	metricdatatest.AssertEqual(t, metricdata.Gauge[int64]{DataPoints: []metricdata.DataPoint[int64]{
		{Attributes: attribute.NewSet(attribute.String("idempotency.record.state", "in_flight")), Value: 2},
		{Attributes: attribute.NewSet(attribute.String("idempotency.record.state", "abandoned")), Value: 1},
	}}, m.Data.(metricdata.Gauge[int64]), metricdatatest.IgnoreTimestamp())

	untrack()
	_, ok = p.collect(t)["idempotency.store.records"]
	assert.False(t, ok, "reported after untrack")
}

// An operator's action is counted by the store call it made last, and one
// that failed by its error type too.
func TestObserverCountsOperatorActions(t *testing.T) {
	ctx := t.Context()
	p := newPipeline(t)
	s := idempotency.NewMemoryStore(idempotency.MemoryOptions{})
	g := idempotency.New(s, idempotency.Options{Observer: p})
	k := idempotency.Key{Scope: "acct_1", Name: "stuck"}
	claimDead(t, ctx, s, k)
	seen, err := s.Inspect(ctx, k)
	require.NoError(t, err)
	require.NoError(t, g.Act(ctx, seen, idempotency.OperatorAction{Disposition: idempotency.Release}))
	// The record changed since it was inspected: refused.
	require.ErrorIs(t, g.Act(ctx, seen, idempotency.OperatorAction{Disposition: idempotency.Release}), idempotency.ErrFenced)

	assertCounter(t, p.collect(t)["idempotency.operator.actions"], "{action}",
		point{attrs: []attribute.KeyValue{storeOp("release")}, value: 1},
		point{attrs: []attribute.KeyValue{storeOp("claim"), errType("fenced")}, value: 1})
}
