// Package idempotencyotel turns the events of an idempotency.Guard into
// OpenTelemetry metrics, spans and span events. Set an Observer from
// NewObserver as idempotency.Options.Observer:
//
//	obs, err := idempotencyotel.NewObserver(idempotencyotel.Options{})
//	if err != nil { ... }
//	guard := idempotency.New(store, idempotency.Options{Observer: obs})
//
// # What is reported
//
// Each call of Guard.Do or of the middleware counts once in
// idempotency.outcomes and idempotency.call.duration, and, if it waited for
// an original in flight, in idempotency.wait.duration. Renewals, takeovers
// and sweeps have counters of their own. The operations a Guard runs in
// this process and its calls waiting are read from Guard.InFlight when the
// metrics are collected, for the Guards given to Observer.Track (events
// report ends, never starts, so they cannot give these). README.md lists
// every metric with its unit and attributes.
//
// Each call is also one span, idempotency.call, of kind Internal, a child of
// the span in the call's context (the request's span under otelhttp), or a
// root span when there is none; its phases (claim, wait, run, settle) are
// spans under it (see StartPhase). Renewals, takeovers and sweeps are not
// spans: they are events on the span in their context, when that span is
// recording.
//
// # What is not reported, and why
//
//   - No metric carries the key's scope: scopes are tenants, and tenants
//     are unbounded, so each would make a time series of its own. Spans
//     leave it out too: an application that wants the tenant on its traces
//     puts it on its own request span.
//   - Nothing carries the key or a body: they are the client's data. The
//     fencing token is on the run and settle spans only, never on a metric,
//     where a value different for every call would make a series of its own.
//   - An error's text is never an attribute value: error.type takes the
//     outcome's name, or fenced / unavailable for a failed renewal or
//     sweep, or _OTHER. Only the calls whose span is marked an error (see
//     Observer.Observe) record the error itself, as an exception event.
package idempotencyotel

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/idempotency-go/idempotency"
)

// ScopeName is the instrumentation scope of every meter and tracer the
// Observer gets, the core module's import path: a View or a sampler can
// select the library's metrics and spans by it.
const ScopeName = "github.com/idempotency-go/idempotency"

// Attribute keys of this library. error.type, http.request.method and
// http.route are the semantic conventions' own.
const (
	keyOutcome        = attribute.Key("idempotency.outcome")
	keyStoreOperation = attribute.Key("idempotency.store.operation")
	keyAttempt        = attribute.Key("idempotency.attempt")
	keyToken          = attribute.Key("idempotency.token")
	keyRecordState    = attribute.Key("idempotency.record.state")
	keyWaitDuration   = attribute.Key("idempotency.wait.duration")
	keyRenewalResult  = attribute.Key("idempotency.renewal.result")
	keyRenewalDur     = attribute.Key("idempotency.renewal.duration")
	keyTakeoverPrev   = attribute.Key("idempotency.takeover.previous")
	keySweepResult    = attribute.Key("idempotency.sweep.result")
	keySweepFound     = attribute.Key("idempotency.sweep.found")
	keySweepSettled   = attribute.Key("idempotency.sweep.settled")
	keySweepLeft      = attribute.Key("idempotency.sweep.left")
	keySweepDuration  = attribute.Key("idempotency.sweep.duration")
)

// Names of the span and of the span events.
const (
	spanCall      = "idempotency.call"
	eventRenewal  = "idempotency.renewal"
	eventTakeover = "idempotency.takeover"
	eventSweep    = "idempotency.sweep"
)

// durationBuckets are the histograms' advised bucket boundaries, in
// seconds: from a replay out of a nearby store (under a millisecond) to a
// call that waited out the default WaitTimeout and lease (10s) and more. A
// View overrides them.
var durationBuckets = []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}

// Options configures NewObserver. The zero value uses the global providers.
type Options struct {
	// MeterProvider provides the meter of every metric. Default
	// otel.GetMeterProvider(), as it is when NewObserver is called (the
	// global provider forwards to one set later).
	MeterProvider metric.MeterProvider
	// TracerProvider provides the tracer of the spans. Default
	// otel.GetTracerProvider(), as it is when NewObserver is called.
	TracerProvider trace.TracerProvider
}

// Observer is an idempotency.Observer that records every event as the
// metrics, spans and span events listed in README.md. It is safe for
// concurrent use, and one Observer may serve several Guards.
type Observer struct {
	tracer trace.Tracer

	outcomes, renewals, takeovers, sweepRecords, sweeps metric.Int64Counter
	operatorActions                                     metric.Int64Counter
	callDuration, waitDuration, renewalDuration         metric.Float64Histogram
	operations, waiters                                 metric.Int64ObservableUpDownCounter
	storeRecords                                        metric.Int64ObservableGauge

	mu     sync.Mutex
	guards map[*idempotency.Guard]int // the Guards tracked, with how many Track calls each
	stores map[*StatsReader]struct{}  // the stores tracked by TrackStore, one entry per call
}

// StatsReader is a store that counts its records in flight: the Redis and
// memory stores of the core, and the postgres package's, all are.
type StatsReader interface {
	Stats(ctx context.Context) (idempotency.Stats, error)
}

// statsTimeout bounds each collection's Stats calls: a store that hangs
// leaves the gauge out of that collection instead of holding it up.
const statsTimeout = 5 * time.Second

var _ idempotency.Observer = (*Observer)(nil)

// NewObserver returns an Observer whose instruments and tracer come from
// opts' providers, under the scope ScopeName. It fails only if the meter
// refuses to make an instrument; the Observer it then returns is usable all
// the same, and records what the meter's instruments can.
func NewObserver(opts Options) (*Observer, error) {
	mp, tp := opts.MeterProvider, opts.TracerProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	m := &instruments{meter: mp.Meter(ScopeName, metric.WithSchemaURL(semconv.SchemaURL))}
	o := &Observer{tracer: tp.Tracer(ScopeName, trace.WithSchemaURL(semconv.SchemaURL))}
	o.outcomes = m.counter("idempotency.outcomes", "{call}", "Calls of a Guard that ended, by outcome.")
	o.callDuration = m.histogram("idempotency.call.duration", "Duration of the calls of a Guard, waits included.")
	o.waitDuration = m.histogram("idempotency.wait.duration", "Time the calls that waited spent waiting for an original in flight.")
	o.renewals = m.counter("idempotency.renewals", "{renewal}", "Renewals of an owner's lease that returned, confirmed or failed.")
	o.renewalDuration = m.histogram("idempotency.renewal.duration", "Round trip of the renewals of an owner's lease.")
	o.takeovers = m.counter("idempotency.takeovers", "{takeover}", "Claims that took a record over from an earlier attempt.")
	o.sweepRecords = m.counter("idempotency.sweep.records", "{record}",
		"Abandoned records that sweeps found, settled through Recover, and left for later.")
	o.sweeps = m.counter("idempotency.sweeps", "{sweep}", "Sweeps of abandoned records that ended.")
	o.operatorActions = m.counter("idempotency.operator.actions", "{action}",
		"Operators' actions on records (Guard.Act) that ended, by the store call made last, and the error type of those that failed.")
	o.operations = m.upDown("idempotency.operation.count", "{operation}",
		"Operations that the tracked Guards run as the owner in this process now, Recover hooks and sweeps included.")
	o.waiters = m.upDown("idempotency.waiter.count", "{call}",
		"Calls of the tracked Guards waiting for an original in flight now.")
	m.callback(o.observeInFlight, o.operations, o.waiters)
	o.storeRecords = m.gauge("idempotency.store.records", "{record}",
		"Records in flight in the tracked stores, by state: in_flight (the owner's lease is live) "+
			"or abandoned (the lease ran out unsettled; waiting for a retry or a sweep).")
	m.callback(o.observeStores, o.storeRecords)
	return o, errors.Join(m.errs...)
}

// instruments makes an Observer's instruments on one meter, keeping every
// error; an instrument the meter could not make is a no-op one.
type instruments struct {
	meter metric.Meter
	errs  []error
}

func (m *instruments) counter(name, unit, desc string) metric.Int64Counter {
	c, err := m.meter.Int64Counter(name, metric.WithUnit(unit), metric.WithDescription(desc))
	return made(m, c, err, metric.Int64Counter(noop.Int64Counter{}))
}

func (m *instruments) histogram(name, desc string) metric.Float64Histogram {
	h, err := m.meter.Float64Histogram(name, metric.WithUnit("s"), metric.WithDescription(desc),
		metric.WithExplicitBucketBoundaries(durationBuckets...))
	return made(m, h, err, metric.Float64Histogram(noop.Float64Histogram{}))
}

func (m *instruments) upDown(name, unit, desc string) metric.Int64ObservableUpDownCounter {
	c, err := m.meter.Int64ObservableUpDownCounter(name, metric.WithUnit(unit), metric.WithDescription(desc))
	return made(m, c, err, metric.Int64ObservableUpDownCounter(noop.Int64ObservableUpDownCounter{}))
}

func (m *instruments) gauge(name, unit, desc string) metric.Int64ObservableGauge {
	g, err := m.meter.Int64ObservableGauge(name, metric.WithUnit(unit), metric.WithDescription(desc))
	return made(m, g, err, metric.Int64ObservableGauge(noop.Int64ObservableGauge{}))
}

// made keeps err and returns instrument i, or none if the meter made none.
func made[I comparable](m *instruments, i I, err error, none I) I {
	m.errs = append(m.errs, err)
	var zero I
	if i == zero {
		return none
	}
	return i
}

func (m *instruments) callback(f metric.Callback, of ...metric.Observable) {
	_, err := m.meter.RegisterCallback(f, of...)
	m.errs = append(m.errs, err)
}

// Track adds g's operations in flight and calls waiting, as Guard.InFlight
// counts them, to idempotency.operation.count and idempotency.waiter.count,
// which are read when the metrics are collected, until untrack is called
// (again: nothing more). With no Guard tracked, neither is reported. A Guard
// tracked twice is counted once, until both are untracked. Give Track the
// Guard that this Observer observes: the Guard must exist first, so it
// cannot be an Option.
func (o *Observer) Track(g *idempotency.Guard) (untrack func()) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.guards == nil {
		o.guards = map[*idempotency.Guard]int{}
	}
	o.guards[g]++
	var once sync.Once
	return func() {
		once.Do(func() {
			o.mu.Lock()
			defer o.mu.Unlock()
			if o.guards[g]--; o.guards[g] == 0 {
				delete(o.guards, g)
			}
		})
	}
}

// TrackStore reports s's Stats as idempotency.store.records, with
// idempotency.record.state = in_flight or abandoned, read from the store
// each time the metrics are collected, until untrack is called. Every
// process that shares a store reports the same store-wide counts: alert on
// their max, not their sum. Stores tracked at once are summed. A Stats that
// fails or takes over 5s leaves the gauge out of that collection (the SDK
// reports the error) rather than report zero abandoned records that may be
// there.
func (o *Observer) TrackStore(s StatsReader) (untrack func()) {
	key := &s
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.stores == nil {
		o.stores = map[*StatsReader]struct{}{}
	}
	o.stores[key] = struct{}{}
	return func() {
		o.mu.Lock()
		defer o.mu.Unlock()
		delete(o.stores, key)
	}
}

func (o *Observer) observeStores(ctx context.Context, obs metric.Observer) error {
	o.mu.Lock()
	stores := make([]StatsReader, 0, len(o.stores))
	for s := range o.stores {
		stores = append(stores, *s)
	}
	o.mu.Unlock()
	if len(stores) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, statsTimeout)
	defer cancel()
	var total idempotency.Stats
	for _, s := range stores {
		st, err := s.Stats(ctx)
		if err != nil {
			return fmt.Errorf("idempotency store stats: %w", err)
		}
		total.InFlight += st.InFlight
		total.Abandoned += st.Abandoned
	}
	obs.ObserveInt64(o.storeRecords, total.InFlight, metric.WithAttributes(keyRecordState.String("in_flight")))
	obs.ObserveInt64(o.storeRecords, total.Abandoned, metric.WithAttributes(keyRecordState.String("abandoned")))
	return nil
}

// observeInFlight reports the tracked Guards' sums, one observation of
// each instrument as the API asks, however many Guards there are.
func (o *Observer) observeInFlight(_ context.Context, obs metric.Observer) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if len(o.guards) == 0 {
		return nil
	}
	var operations, waiting int
	for g := range o.guards {
		ops, w := g.InFlight()
		operations += ops
		waiting += w
	}
	obs.ObserveInt64(o.operations, int64(operations))
	obs.ObserveInt64(o.waiters, int64(waiting))
	return nil
}

// Observe records e. An EventOutcome becomes one idempotency.call span
// (see the package's doc), started Duration before now, and a count in
// idempotency.outcomes and idempotency.call.duration (and
// idempotency.wait.duration if the call waited); the span is marked an
// error, described by the outcome's name, and records e.Err, for the
// outcomes that are the service's failures: fenced, unavailable,
// recovery_unknown and failed_open; the others (a client's mismatch, a
// retry still in flight, an application's error that released the record)
// leave its status unset. A renewal, takeover or sweep is counted, and
// added as an event to the span in ctx when it is recording; an operator's
// action is counted in idempotency.operator.actions. Every
// measurement is made with the call's context (for an outcome, that of its
// new span), so a metric SDK that samples exemplars links them to the
// trace. Events of another kind are ignored.
func (o *Observer) Observe(ctx context.Context, e idempotency.Event) {
	switch e.Kind {
	case idempotency.EventOutcome:
		o.outcome(ctx, e)
	case idempotency.EventRenewal:
		o.renewal(ctx, e)
	case idempotency.EventTakeover:
		o.takeover(ctx, e)
	case idempotency.EventSweep:
		o.sweep(ctx, e)
	case idempotency.EventOperator:
		attrs := []attribute.KeyValue{keyStoreOperation.String(e.Op)}
		if e.Err != nil {
			attrs = append(attrs, semconv.ErrorTypeKey.String(storeErrorType(e.Err)))
		}
		o.operatorActions.Add(ctx, 1, metric.WithAttributes(attrs...))
	}
}

func (o *Observer) outcome(ctx context.Context, e idempotency.Event) {
	end := time.Now()
	outcome := keyOutcome.String(e.Outcome.String())
	attrs := make([]attribute.KeyValue, 0, 7)
	attrs = append(attrs, outcome)
	if e.Method != "" {
		attrs = append(attrs, semconv.HTTPRequestMethodKey.String(httpMethod(e.Method)))
	}
	if route := httpRoute(e.Route); route != "" {
		attrs = append(attrs, semconv.HTTPRouteKey.String(route))
	}
	if e.Op != "" {
		attrs = append(attrs, keyStoreOperation.String(e.Op))
	}
	if e.Err != nil {
		attrs = append(attrs, semconv.ErrorTypeKey.String(outcomeErrorType(e.Outcome)))
	}
	// The set is made from a copy: NewSet sorts what it is given.
	set := attribute.NewSet(append([]attribute.KeyValue(nil), attrs...)...)
	if e.Attempt > 0 {
		attrs = append(attrs, keyAttempt.Int(e.Attempt))
	}
	if e.Waited > 0 {
		attrs = append(attrs, keyWaitDuration.Float64(e.Waited.Seconds()))
	}
	ctx = o.endCall(ctx, e, attrs, end)

	o.outcomes.Add(ctx, 1, metric.WithAttributeSet(set))
	o.callDuration.Record(ctx, e.Duration.Seconds(), metric.WithAttributeSet(set))
	if e.Waited > 0 {
		o.waitDuration.Record(ctx, e.Waited.Seconds(), metric.WithAttributes(outcome))
	}
}

// endCall gives the call's span, which StartPhase began and which ends with
// the phase, the outcome's attributes and status; a call reported without
// one (a request the middleware refused before the store) gets a span after
// the fact, ended at end. It returns the context of that span.
func (o *Observer) endCall(ctx context.Context, e idempotency.Event, attrs []attribute.KeyValue, end time.Time) context.Context {
	span, live := ctx.Value(callSpanKey{}).(trace.Span)
	if live {
		span.SetAttributes(attrs...)
	} else {
		ctx, span = o.tracer.Start(ctx, spanCall, trace.WithSpanKind(trace.SpanKindInternal),
			trace.WithTimestamp(end.Add(-e.Duration)), trace.WithAttributes(attrs...))
	}
	if serviceFailure(e.Outcome) {
		if e.Err != nil {
			span.RecordError(e.Err, trace.WithTimestamp(end))
		}
		span.SetStatus(codes.Error, e.Outcome.String())
	}
	if !live {
		span.End(trace.WithTimestamp(end))
	}
	return ctx
}

// callSpanKey marks, in a call's context, the span StartPhase began for
// the call.
type callSpanKey struct{}

var _ idempotency.PhaseObserver = (*Observer)(nil)

// StartPhase implements idempotency.PhaseObserver: each phase of a call is
// a span of kind Internal named idempotency.<phase> (idempotency.claim,
// .wait, .run, .settle), a child of the call's span, idempotency.call,
// which is a child of the span in the call's context. The run and settle
// spans carry the owner's attempt and fencing token. A phase that ends in
// an error has status Error, described by the phase's name: the error's
// text, which may be the application's, is not recorded. The call's span
// gets its outcome from the call's EventOutcome.
func (o *Observer) StartPhase(ctx context.Context, p idempotency.Phase, s idempotency.PhaseStart) (context.Context, func(error)) {
	opts := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindInternal)}
	if s.Attempt > 0 {
		// Tokens are issued from 1 up to MaxInt64.
		opts = append(opts, trace.WithAttributes(keyAttempt.Int(s.Attempt), keyToken.Int64(int64(s.Token))))
	}
	ctx, span := o.tracer.Start(ctx, "idempotency."+p.String(), opts...)
	if p == idempotency.PhaseCall {
		return context.WithValue(ctx, callSpanKey{}, span), func(error) { span.End() }
	}
	return ctx, func(err error) {
		if err != nil {
			span.SetStatus(codes.Error, p.String())
		}
		span.End()
	}
}

func (o *Observer) renewal(ctx context.Context, e idempotency.Event) {
	attrs := make([]attribute.KeyValue, 0, 4)
	if e.Err == nil {
		attrs = append(attrs, keyRenewalResult.String("confirmed"))
	} else {
		attrs = append(attrs, keyRenewalResult.String("failed"), semconv.ErrorTypeKey.String(storeErrorType(e.Err)))
	}
	set := attribute.NewSet(append([]attribute.KeyValue(nil), attrs...)...)
	o.renewals.Add(ctx, 1, metric.WithAttributeSet(set))
	o.renewalDuration.Record(ctx, e.Duration.Seconds(), metric.WithAttributeSet(set))
	if span := trace.SpanFromContext(ctx); span.IsRecording() {
		attrs = append(attrs, keyRenewalDur.Float64(e.Duration.Seconds()))
		if e.Attempt > 0 {
			attrs = append(attrs, keyAttempt.Int(e.Attempt))
		}
		span.AddEvent(eventRenewal, trace.WithAttributes(attrs...))
	}
}

func (o *Observer) takeover(ctx context.Context, e idempotency.Event) {
	previous := keyTakeoverPrev.String("released")
	if e.Abandoned {
		previous = keyTakeoverPrev.String("abandoned")
	}
	o.takeovers.Add(ctx, 1, metric.WithAttributes(previous))
	if span := trace.SpanFromContext(ctx); span.IsRecording() {
		attrs := []attribute.KeyValue{previous}
		if e.Attempt > 0 {
			attrs = append(attrs, keyAttempt.Int(e.Attempt))
		}
		span.AddEvent(eventTakeover, trace.WithAttributes(attrs...))
	}
}

func (o *Observer) sweep(ctx context.Context, e idempotency.Event) {
	for _, r := range [...]struct {
		result string
		n      int
	}{{"found", e.Found}, {"settled", e.Settled}, {"left", e.Left}} {
		o.sweepRecords.Add(ctx, int64(r.n), metric.WithAttributes(keySweepResult.String(r.result)))
	}
	var errType []attribute.KeyValue
	if e.Err != nil {
		errType = append(errType, semconv.ErrorTypeKey.String(storeErrorType(e.Err)))
	}
	o.sweeps.Add(ctx, 1, metric.WithAttributes(errType...))
	if span := trace.SpanFromContext(ctx); span.IsRecording() {
		attrs := append(errType, keySweepFound.Int(e.Found), keySweepSettled.Int(e.Settled),
			keySweepLeft.Int(e.Left), keySweepDuration.Float64(e.Duration.Seconds()))
		if e.Op != "" {
			attrs = append(attrs, keyStoreOperation.String(e.Op))
		}
		span.AddEvent(eventSweep, trace.WithAttributes(attrs...))
	}
}

// serviceFailure reports whether a call that ended so failed through the
// service's fault (its store, its lease, its recovery), rather than the
// client's or the application's.
func serviceFailure(o idempotency.Outcome) bool {
	switch o {
	case idempotency.OutcomeFenced, idempotency.OutcomeUnavailable, idempotency.OutcomeRecoveryUnknown,
		idempotency.OutcomeFailedOpen:
		return true
	}
	return false
}

// outcomeErrorType is error.type for a call that ended with an error: the
// outcome's name when the outcome is the library's error, and _OTHER for
// the application's own error (its operation failed, and the record was
// released or forgotten).
func outcomeErrorType(o idempotency.Outcome) string {
	switch o {
	case idempotency.OutcomeInFlight, idempotency.OutcomeMismatch, idempotency.OutcomeInvalidKey,
		idempotency.OutcomeFenced, idempotency.OutcomeRecoveryUnknown, idempotency.OutcomeUnavailable,
		idempotency.OutcomeFailedOpen, idempotency.OutcomeClientGone, idempotency.OutcomeRejected:
		return o.String()
	}
	return semconv.ErrorTypeOther.Value.AsString()
}

// storeErrorType is error.type for a failed renewal or sweep: fenced (the
// lease is lost), unavailable (the store failed), or _OTHER.
func storeErrorType(err error) string {
	switch {
	case errors.Is(err, idempotency.ErrFenced):
		return idempotency.OutcomeFenced.String()
	case errors.Is(err, idempotency.ErrUnavailable):
		return idempotency.OutcomeUnavailable.String()
	}
	return semconv.ErrorTypeOther.Value.AsString()
}

// httpMethod is http.request.method as the conventions have it: a method
// they know, or _OTHER.
func httpMethod(m string) string {
	switch m {
	case "CONNECT", "DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "TRACE", "QUERY":
		return m
	}
	return semconv.HTTPRequestMethodOther.Value.AsString()
}

// httpRoute is http.route from a ServeMux pattern, as otelhttp makes it:
// the path template from its first slash, without the pattern's method and
// host ("POST /v1/charges" gives "/v1/charges"). A pattern with no path
// gives "".
func httpRoute(pattern string) string {
	if i := strings.IndexByte(pattern, '/'); i >= 0 {
		return pattern[i:]
	}
	return ""
}
