package idempotency

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Observer is told of every outcome of a Guard's calls and of the events
// between them, for metrics, traces and logs. Observe is called on the
// goroutine that made the call (a renewal's on the owner's timer), after the
// fact, so it must be safe for concurrent use and quick; it never changes
// what the Guard does. An event carries the key's scope, never the key or
// any body. SlogObserver logs events; the otel module turns them into
// OpenTelemetry metrics and spans.
type Observer interface {
	Observe(ctx context.Context, e Event)
}

// PhaseObserver is an Observer that is also told as each phase of a call
// begins, to trace it. The Guard runs the phase in the context StartPhase
// returns, so a span started there is the parent of the spans the phase
// makes (the operation's own, a store client's), and calls end once, with
// the phase's error, when the phase ends. PhaseCall encloses the others,
// and the call's EventOutcome is observed in its context, before its end.
type PhaseObserver interface {
	Observer
	StartPhase(ctx context.Context, p Phase, s PhaseStart) (_ context.Context, end func(err error))
}

// Phase is one stage of a call of Guard.Do or of the middleware.
type Phase int

const (
	// PhaseCall: the whole call, from its start to its answer.
	PhaseCall Phase = iota + 1
	// PhaseClaim: the first claim of the key.
	PhaseClaim
	// PhaseWait: waiting for an original in flight, re-claims included.
	PhaseWait
	// PhaseRun: the operation, or Options.Recover, running as the owner.
	PhaseRun
	// PhaseSettle: the store call that settles the record.
	PhaseSettle
)

var phaseNames = [...]string{PhaseCall: "call", PhaseClaim: "claim", PhaseWait: "wait", PhaseRun: "run", PhaseSettle: "settle"}

// String returns the phase's name.
func (p Phase) String() string {
	if p > 0 && int(p) < len(phaseNames) {
		return phaseNames[p]
	}
	return fmt.Sprintf("Phase(%d)", int(p))
}

// PhaseStart describes a phase as it begins. Attempt and Token are set for
// PhaseRun and PhaseSettle, which the owner runs.
type PhaseStart struct {
	Scope   string
	Attempt int
	Token   uint64
}

// startPhase starts phase p for a PhaseObserver, if the Guard has one.
func (g *Guard) startPhase(ctx context.Context, p Phase, s PhaseStart) (context.Context, func(error)) {
	if g.phases == nil {
		return ctx, noPhaseEnd
	}
	return g.phases.StartPhase(ctx, p, s)
}

func noPhaseEnd(error) {}

// EventKind says what an Event reports.
type EventKind int

const (
	// EventOutcome: a call of Guard.Do or of the middleware ended. Each
	// call reports exactly one, with Outcome, Duration (the whole call) and
	// Waited set.
	EventOutcome EventKind = iota + 1
	// EventRenewal: the owner's renewal of its lease returned, confirmed or
	// not (Err); Duration is its round trip.
	EventRenewal
	// EventTakeover: a claim took a record over from an earlier attempt;
	// Abandoned says whether that attempt's lease ran out unsettled, as
	// opposed to its releasing the record.
	EventTakeover
	// EventSweep: Guard.Sweep ended, with the records it Found, those the
	// hook Settled, and those Left for later; Duration is the sweep's.
	EventSweep
	// EventOperator: an operator's action (Guard.Act) ended; Op names the
	// store call it made last, Attempt the attempt it took the record over
	// as, and Err why it failed, if it did.
	EventOperator
)

// Outcome is how a call of Guard.Do or of the middleware ended.
type Outcome int

const (
	// OutcomeExecuted: the operation ran and its outcome was stored.
	OutcomeExecuted Outcome = iota + 1
	// OutcomeReplayed: a stored outcome was answered at once.
	OutcomeReplayed
	// OutcomeWaitedReplayed: the call waited for the original, then
	// answered its stored outcome.
	OutcomeWaitedReplayed
	// OutcomeWaitedOwner: the call waited, then became the owner (the
	// original released the record or stopped renewing its lease), ran the
	// operation and stored its outcome.
	OutcomeWaitedOwner
	// OutcomeInFlight: the original was still running when the wait ended
	// (or none was allowed, or MaxWaiters were waiting): ErrInFlight.
	OutcomeInFlight
	// OutcomeMismatch: the key belongs to another request: ErrMismatch.
	OutcomeMismatch
	// OutcomeInvalidKey: the key was refused before the store was asked:
	// ErrInvalidKey, or for the middleware a key missing or sent twice.
	OutcomeInvalidKey
	// OutcomeFenced: the lease ended before the outcome was stored:
	// ErrFenced.
	OutcomeFenced
	// OutcomeRecovered: Options.Recover settled an abandoned operation,
	// whose outcome was answered as a replay.
	OutcomeRecovered
	// OutcomeRecoveryUnknown: Options.Recover could not tell what became of
	// an abandoned operation; the record stays abandoned (ErrInFlight).
	OutcomeRecoveryUnknown
	// OutcomeReleased: the operation ran and the record was released for a
	// retry, by its disposition or because it failed (Err).
	OutcomeReleased
	// OutcomeForgotten: the operation ran and the record was deleted, by
	// its disposition.
	OutcomeForgotten
	// OutcomeUnavailable: a store call failed (Op names it): ErrUnavailable.
	OutcomeUnavailable
	// OutcomeFailedOpen: the store could not be reached to claim the key,
	// and the middleware ran the handler unguarded (MiddlewareOptions.FailOpen).
	OutcomeFailedOpen
	// OutcomeClientGone: the caller's context ended before the answer: the
	// client went away. The store may be healthy.
	OutcomeClientGone
	// OutcomeRejected: the middleware refused the request before it ran,
	// for its scope (MiddlewareOptions.Scope failed), its body (unreadable,
	// or over MaxRequestBytes), or a key older than the retention whose
	// record is gone (ErrKeyExpired).
	OutcomeRejected
)

var outcomeNames = [...]string{
	OutcomeExecuted: "executed", OutcomeReplayed: "replayed", OutcomeWaitedReplayed: "waited_replayed",
	OutcomeWaitedOwner: "waited_owner", OutcomeInFlight: "in_flight", OutcomeMismatch: "mismatch",
	OutcomeInvalidKey: "invalid_key", OutcomeFenced: "fenced", OutcomeRecovered: "recovered",
	OutcomeRecoveryUnknown: "recovery_unknown", OutcomeReleased: "released", OutcomeForgotten: "forgotten",
	OutcomeUnavailable: "unavailable", OutcomeFailedOpen: "failed_open", OutcomeClientGone: "client_gone",
	OutcomeRejected: "rejected",
}

// String returns the outcome's name in snake case, as metrics label it.
func (o Outcome) String() string {
	if o > 0 && int(o) < len(outcomeNames) {
		return outcomeNames[o]
	}
	return fmt.Sprintf("Outcome(%d)", int(o))
}

var eventNames = [...]string{EventOutcome: "outcome", EventRenewal: "renewal", EventTakeover: "takeover", EventSweep: "sweep",
	EventOperator: "operator"}

// String returns the kind's name.
func (k EventKind) String() string {
	if k > 0 && int(k) < len(eventNames) {
		return eventNames[k]
	}
	return fmt.Sprintf("EventKind(%d)", int(k))
}

// Store operations, as Event.Op names them.
const (
	OpClaim     = "claim"
	OpSubscribe = "subscribe"
	OpComplete  = "complete"
	OpRelease   = "release"
	OpForget    = "forget"
	OpRenew     = "renew"
	OpAbandon   = "abandon"
	OpAbandoned = "abandoned"
)

// Event is one report to an Observer. Fields that do not apply to its Kind
// are zero.
type Event struct {
	Kind    EventKind
	Outcome Outcome
	Scope   string // the key's scope (Key.Scope)
	// Method and Route are the request's method and its ServeMux pattern
	// (http.Request.Pattern), set by the middleware.
	Method, Route string
	Attempt       int           // the owner's attempt, when the call owned the record
	Duration      time.Duration // see EventKind
	Waited        time.Duration // how long the call waited for an original in flight
	Op            string        // the store call that failed (Op* constants)
	Err           error         // the call's error, if any
	Abandoned     bool          // EventTakeover
	// EventSweep: the abandoned records listed, those settled through
	// Options.Recover, and the rest.
	Found, Settled, Left int
}

// callState is what one call of Do learns on its way, so that its Outcome can be
// told once at the end. It lives on the caller's stack: the owner keeps its
// own part (owner.t) and hands it back.
type callState struct {
	start         time.Time
	method, route string
	failOpen      func()  // runs the operation unguarded (see Guard.call); nil: never
	decided       Outcome // the outcome, when the transport or failOpen decided it
	waited        time.Duration
	op            string // the store call that failed, if one did
	disposition   Disposition
	owned         bool      // the call became the owner
	keyMade       time.Time // when the key was made, if the transport knows (see refuseExpired)
	others        rematcher // the request under other fingerprint rules, if the transport knows them
	attempt       int
	recovered     bool // Options.Recover settled the record
	unknown       bool // Options.Recover could not tell
}

// newCall starts the callState of a call made for the HTTP method and route
// ("" for Do), timed when there is an Observer to tell.
func (g *Guard) newCall(method, route string) callState {
	cs := callState{method: method, route: route}
	if g.opts.Observer != nil {
		cs.start = time.Now()
	}
	return cs
}

// observe tells the Guard's Observer of e, if it has one.
func (g *Guard) observe(ctx context.Context, e Event) {
	if g.opts.Observer != nil {
		g.opts.Observer.Observe(ctx, e)
	}
}

// report tells the Observer how the call cs, for a key of scope, ended.
func (g *Guard) report(ctx context.Context, scope string, cs *callState, res Result, err error) {
	if g.opts.Observer == nil {
		return
	}
	g.opts.Observer.Observe(ctx, Event{Kind: EventOutcome, Outcome: cs.outcome(ctx, res, err), Scope: scope,
		Method: cs.method, Route: cs.route, Attempt: cs.attempt, Duration: time.Since(cs.start), Waited: cs.waited,
		Op: cs.op, Err: err})
}

// outcome classifies the call's end. The order matters: a client that went
// away is no store outage, and an outage during a wait is an outage.
func (cs *callState) outcome(ctx context.Context, res Result, err error) Outcome {
	switch {
	case cs.decided != 0:
		return cs.decided
	case err == nil && res.Replayed && cs.recovered:
		return OutcomeRecovered
	case err == nil && res.Replayed && cs.waited > 0:
		return OutcomeWaitedReplayed
	case err == nil && res.Replayed:
		return OutcomeReplayed
	case cs.owned && cs.disposition == Release:
		return OutcomeReleased
	case cs.owned && cs.disposition == Forget:
		return OutcomeForgotten
	case err == nil && cs.waited > 0:
		return OutcomeWaitedOwner
	case err == nil:
		return OutcomeExecuted
	case errors.Is(err, ErrFenced):
		return OutcomeFenced
	case ctx.Err() != nil:
		return OutcomeClientGone
	case errors.Is(err, ErrInvalidKey):
		return OutcomeInvalidKey
	case errors.Is(err, ErrMismatch):
		return OutcomeMismatch
	case cs.unknown:
		return OutcomeRecoveryUnknown
	case cs.op != "" || errors.Is(err, ErrUnavailable):
		return OutcomeUnavailable
	}
	return OutcomeInFlight
}
