// Package idempotency makes a retried, non-idempotent operation (a charge, an
// order, a transfer) run at most once, and answers every retry with the same
// response, across any number of processes that share one store.
//
// A client sends an Idempotency-Key with a POST; however many times that
// request arrives, at whichever instance, concurrently or a day later, the
// handler runs once and every retry gets its stored answer:
//
//	rdb := redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true})
//	store, err := idempotency.NewRedisStore(rdb, idempotency.RedisOptions{})
//	if err != nil {
//		return err
//	}
//	defer store.Close()
//	if err := store.CheckEviction(ctx); err != nil { // a Redis that evicts loses records
//		return err
//	}
//	guard := idempotency.New(store, idempotency.Options{})
//	charges := guard.Middleware(idempotency.MiddlewareOptions{
//		Scope: func(r *http.Request) (string, error) { return accountOf(r) }, // keys are per account
//	})
//	mux.Handle("POST /v1/charges", charges(http.HandlerFunc(createCharge)))
//
// In the handler, DownstreamKey(r.Context(), "gateway") is the key to send to
// a payment provider: the same for every attempt at the operation, so that a
// retry after a crash cannot charge twice.
//
// What a user needs: New and Options; Guard.Middleware and MiddlewareOptions
// for net/http (with SingleTenant, ProblemDetails, StripeErrors); Guard.Do,
// Key and FingerprintOf (or Run, for a typed result) for queues, webhooks
// and jobs; FromContext, Info, DownstreamKey and SetDisposition inside an
// operation, and Step for an operation of several steps, which a retry after
// a crash resumes after the last one that finished; Transport on the
// calling side; the stores NewRedisStore (production), NewMemoryStore (tests)
// and, in the postgres package, a PostgreSQL store whose CompleteTx completes
// inside the application's own transaction; and the errors ErrMismatch,
// ErrInFlight, ErrUnavailable, ErrFenced and ErrInvalidKey.
//
// For store implementers only: Store, Subscription, ClaimRequest, Claim,
// ClaimState, AbandonedRecord, Stats, RecoveryPointStore, CompleteOutside and
// SaveStepOutside; a store of one's
// own must pass the conformance suite in package idempotencytest.
//
// Every record is identified by a Key (a scope such as an account id, and the
// client's idempotency key) and bound to the Fingerprint of the request that
// created it. Its life is a small state machine judged by the store's clock:
// the first claim creates it in flight under a lease and a fencing token; the
// owner completes it (its response is kept and replayed for the retention
// window) or releases it (the next retry becomes the owner, with the same
// operation ID); an owner whose lease ran out can be taken over, and from then
// on it can change nothing. The repository's docs folder explains the HTTP
// contract, the stores, operating it and the evidence for each guarantee.
package idempotency

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base32"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idempotency-go/idempotency/internal/storeerr"
)

// Errors returned by Guard.Do and by stores. Check them with errors.Is.
var (
	// ErrMismatch: the key was already used with a request whose fingerprint
	// differs. Nothing ran.
	ErrMismatch = errors.New("idempotency: key reused with a different request")
	// ErrInFlight: the original request is still running and did not finish
	// within the wait timeout, or too many requests already wait. Nothing ran;
	// the client should retry later with the same key.
	ErrInFlight = errors.New("idempotency: original request still in flight")
	// ErrFenced: the caller is no longer the record's owner: its lease ended
	// (it ran out on this process's clock, or the store refused a renewal
	// because another attempt took over or the record was settled). The
	// change it asked for was not made.
	ErrFenced = storeerr.ErrFenced
	// ErrUnavailable: the store could not be reached or failed. Whether the
	// operation ran is decided by the record, never by guessing: a retry finds
	// out.
	ErrUnavailable = storeerr.ErrUnavailable
	// ErrUnknown is for Options.Recover to return when it cannot yet tell
	// what became of an abandoned operation.
	ErrUnknown = errors.New("idempotency: outcome of the abandoned attempt not known yet")
	// ErrKeyExpired: the key was made longer ago than Options.Retention
	// (MiddlewareOptions.KeyTime tells when) and no record of it is left:
	// the request may retry an operation whose answer is no longer kept, so
	// it is refused instead of run blindly. Nothing ran; the client must
	// learn the operation's fate another way, and use a new key.
	ErrKeyExpired = errors.New("idempotency: key older than the retention")
	// ErrInvalidKey: the idempotency key is empty, longer than MaxKeyLength,
	// or holds a byte that is not visible ASCII.
	ErrInvalidKey = errors.New("idempotency: invalid key")
	// ErrNoOperation: the context carries no operation of a Guard (it does
	// not come from Guard.Do or the middleware), so there is no key, token
	// or operation ID to act under.
	ErrNoOperation = errors.New("idempotency: the context carries no operation")
	// ErrForeignStore: a store was asked to complete an operation whose
	// Guard keeps its records in another store. Nothing was stored.
	ErrForeignStore = errors.New("idempotency: the operation's records are kept in another store")
)

// MaxKeyLength is the longest idempotency key accepted, in bytes.
const MaxKeyLength = 255

// Key identifies a record. Scope separates tenants: two scopes never see each
// other's records, whatever keys their clients choose.
type Key struct {
	Scope string // an account or tenant id; may be empty for a single tenant
	Name  string // the client's idempotency key: 1..MaxKeyLength visible ASCII
}

// Validate reports ErrInvalidKey when k.Name is not 1..MaxKeyLength bytes of
// visible ASCII (0x21-0x7e).
func (k Key) Validate() error {
	if len(k.Name) == 0 || len(k.Name) > MaxKeyLength {
		return fmt.Errorf("%w: length %d, want 1..%d", ErrInvalidKey, len(k.Name), MaxKeyLength)
	}
	if i := invisible(k.Name); i >= 0 {
		return fmt.Errorf("%w: byte 0x%02x at %d is not visible ASCII", ErrInvalidKey, k.Name[i], i)
	}
	return nil
}

// invisible returns the index of the first byte of s that is not visible
// ASCII (0x21-0x7e), the alphabet of keys and step names, or -1.
func invisible(s string) int {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x21 || c > 0x7e {
			return i
		}
	}
	return -1
}

// Response is an operation's outcome as it is stored and replayed. For HTTP it
// is the handler's status, headers and body; other transports may use Status
// and Body as they please.
type Response struct {
	Status int
	Header http.Header
	Body   []byte
}

// Disposition says what becomes of a record when its operation ends.
type Disposition int

const (
	// Keep stores the response and replays it to every retry.
	Keep Disposition = iota
	// Release frees the key: the next retry becomes the owner and runs the
	// operation again with the same operation ID. Use it when the operation
	// failed in a way a retry may fix (the HTTP default for 5xx).
	Release
	// Forget deletes the record: the key may be used again, even with a
	// different request. Use it when the operation never began (the HTTP
	// default for the refusals DefaultDisposition lists). An operation that
	// may have had an effect is never erased: on a takeover (Info.Takeover)
	// or once the attempt began a Step, Forget releases the record instead,
	// keeping its operation ID, attempt count and recovery points, so the
	// next attempt resumes under the same DownstreamKey. Only an operator's
	// forced Guard.Act erases such a record.
	Forget
	// Settled says the operation already stored its outcome itself, in its
	// own transaction (see the postgres package's Store.CompleteTx), so the
	// Guard writes nothing, and a renewal refused after that is expected.
	Settled
)

func (d Disposition) String() string {
	switch d {
	case Keep:
		return "keep"
	case Release:
		return "release"
	case Forget:
		return "forget"
	case Settled:
		return "settled"
	}
	return fmt.Sprintf("Disposition(%d)", int(d))
}

// Options configures a Guard. The zero value of every field is its documented
// default.
type Options struct {
	// Lease is how long an owner holds a record without renewing it. While
	// the operation runs the Guard renews the lease every Lease/3; an owner
	// that stops (crash, pause, or a store it cannot reach) loses the record
	// one Lease after its last confirmed renewal, and its operation's context
	// ends a margin sooner (see Do). Default 10s.
	Lease time.Duration
	// Retention is how long a record, and so a stored response, is kept. It
	// must outlast the clients' longest retry window. An operation that runs
	// longer keeps its record while it renews its lease. Default 24h.
	Retention time.Duration
	// WaitTimeout is how long a duplicate of an in-flight request waits for
	// the original to finish before failing with ErrInFlight. Default 10s;
	// negative: do not wait.
	WaitTimeout time.Duration
	// RecheckInterval is how often a waiter re-reads the record even without
	// a wake-up; it also re-reads when the original's lease runs out, to
	// take over from an owner that stopped. Default 1s.
	RecheckInterval time.Duration
	// MaxWaiters bounds the requests of one Guard waiting at once; past it a
	// duplicate fails with ErrInFlight at once. Default 10000.
	MaxWaiters int
	// Recover, when set, settles an operation whose previous attempt was
	// abandoned (its owner crashed or stalled past its lease) instead of
	// running it again blindly. It runs as the record's new owner, fenced
	// and renewed like an operation, with the record's Info in its context:
	// typically it asks the downstream service about DownstreamKey.
	//   - It returns a response: that response is stored and answered, as a
	//     replay, and the operation does not run.
	//   - It calls SetDisposition(ctx, Release) and returns no error: the
	//     operation never happened, and Do runs it now.
	//   - It returns an error (ErrUnknown when it cannot tell yet): the
	//     record stays abandoned for a later retry or Sweep, and Do fails
	//     with ErrInFlight.
	// Guard.Sweep runs it on abandoned records that no client retries.
	// Default nil: a retry of an abandoned operation runs it again, with
	// Info.Abandoned set.
	Recover func(ctx context.Context) (Response, error)
	// Observer, when set, is told of every call's outcome and of the events
	// between outcomes (see Observer). Default nil: nothing is reported,
	// and nothing is measured for it.
	Observer Observer
	// CancelWithCaller ends an operation's context when the caller's ends
	// (for net/http, when the client goes away or times out), with the
	// caller's cause; what the operation then returns is its outcome.
	// Default false: once an operation starts it runs to its end whatever
	// the caller does, on a context that keeps the caller's values but not
	// its cancellation or deadline, so that a client that gives up cannot
	// abort a charge half-way and its retry replays the finished outcome.
	// The lease and OperationTimeout still bound it. Claiming and waiting
	// always stop with the caller.
	CancelWithCaller bool
	// OperationTimeout bounds each run of an operation or of Recover: its
	// context ends that long after it starts, with context.DeadlineExceeded,
	// and what it returns is its outcome (a handler's 5xx or an error
	// releases the key, and the retry runs it again under the same
	// operation ID). Without it, a downstream call that hangs would hold
	// its key in flight, every retry answered ErrInFlight (409), for as long
	// as the process runs, since the Guard renews the lease meanwhile.
	// Default 1 minute; negative: no bound but the lease.
	OperationTimeout time.Duration
	// ClaimTimeout bounds each claim (the first, and a waiting duplicate's
	// re-reads) and each wait's subscription: a store that has not answered
	// within it fails the call with ErrUnavailable, so that a request on an
	// instance whose link to the store went silent is answered (a 503 from
	// the middleware) instead of hanging, and its client can retry
	// elsewhere. A claim the store applied but could not answer in time
	// leaves a record that nobody runs: it is taken over once its lease runs
	// out, as after a crash. The bound holds as far as the store's client
	// honours context deadlines: pgx does; go-redis does with
	// redis.Options{ContextTimeoutEnabled: true}, and otherwise gives up
	// within one ReadTimeout. Default 5s: above go-redis's default
	// ReadTimeout (3s), so that a call that first meets a dead node (a
	// cluster client reloading its slots from a failed replica) can still
	// succeed on another; an API that would rather answer 503 sooner sets
	// less, with client timeouts to match. Negative: no bound but the
	// caller's context.
	ClaimTimeout time.Duration
}

func (o Options) withDefaults() Options {
	if o.Lease <= 0 {
		o.Lease = 10 * time.Second
	}
	if o.Retention <= 0 {
		o.Retention = 24 * time.Hour
	}
	if o.WaitTimeout == 0 {
		o.WaitTimeout = 10 * time.Second
	}
	if o.RecheckInterval <= 0 {
		o.RecheckInterval = time.Second
	}
	if o.MaxWaiters <= 0 {
		o.MaxWaiters = 10000
	}
	if o.ClaimTimeout == 0 {
		o.ClaimTimeout = 5 * time.Second
	}
	if o.OperationTimeout == 0 {
		o.OperationTimeout = time.Minute
	}
	return o
}

// Guard runs operations at most once per Key. It is safe for concurrent use;
// Guards in many processes that share a store act as one.
type Guard struct {
	store   Store
	opts    Options
	waiting chan struct{} // one slot per call waiting for an original, Options.MaxWaiters in all
	owners  atomic.Int64  // owners between own and close: operations running here
	phases  PhaseObserver // Options.Observer, when it traces phases
	// callsEndByDeadline: the store vouches that every call returns by its
	// context's deadline (DeadlineBound), so applyWithin calls it on the
	// caller's goroutine.
	callsEndByDeadline bool
	// points is the store as a RecoveryPointStore, or nil when it is none.
	points RecoveryPointStore
}

// InFlight returns how many operations this Guard is running as the owner
// (their functions, Recover hooks and sweeps included) and how many calls
// are waiting for an original in flight: gauges of this process's load,
// read without a store call.
func (g *Guard) InFlight() (operations, waiting int) {
	return int(g.owners.Load()), len(g.waiting)
}

// New returns a Guard that keeps its records in store.
func New(store Store, opts Options) *Guard {
	opts = opts.withDefaults()
	g := &Guard{store: store, opts: opts, waiting: make(chan struct{}, opts.MaxWaiters)}
	g.phases, _ = opts.Observer.(PhaseObserver)
	if d, ok := store.(DeadlineBound); ok {
		g.callsEndByDeadline = d.EndsByDeadline(store)
	}
	g.points, _ = store.(RecoveryPointStore)
	return g
}

// Result is what Guard.Do returns: the operation's response, and whether it
// was replayed from an earlier attempt rather than produced by this call.
type Result struct {
	Response    Response
	Replayed    bool // stored earlier, or settled by Options.Recover
	OperationID string
}

// Do runs fn at most once for k, however many times and wherever Do is called
// with the same k, and returns its response to every caller.
//
//   - The first call claims k and runs fn; the Response it returns is stored
//     before Do returns it (unless fn chose another Disposition with
//     SetDisposition). If fn returns an error, the record is released and
//     the error returned: a later call runs fn again, with the same
//     operation ID.
//   - A call with the same k and fp after completion returns the stored
//     Response with Replayed set, without running fn.
//   - A call while another holds k waits up to Options.WaitTimeout for it to
//     finish, then replays, or becomes the owner if the original released
//     the record or stopped renewing its lease; on time-out it fails with
//     ErrInFlight.
//   - A call whose fp differs from the record's fails with ErrMismatch.
//
// fn's context carries the record's Info (see FromContext). It is
// cancelled, with a cause that matches ErrFenced, when the lease ends: at
// once when the store refuses a renewal, and at the latest Lease - margin
// after the last claim or renewal that the store confirmed was sent, by this
// process's clock, whatever the store or the network does (margin is
// Lease/20, at least 10ms and at most Lease/4). The store counts its lease
// from when it applied that call, so no other attempt can own the record
// while fn's context is live. It does not end when ctx does, unless
// Options.CancelWithCaller says so: fn runs to its end, its outcome is
// stored, and Do returns it even to a caller that has gone (ctx bounds the
// claim and the wait only). Options.OperationTimeout bounds fn's run.
// If the lease ends before fn returns, the Guard stores
// nothing and Do returns ErrFenced (an operation that stored its outcome
// itself, see Settled, may still have committed it).
//
// Do returns when fn has returned and the record is settled: it waits for a
// renewal in progress as long as a sound connection would take (twice the
// last round trip, plus the margin), and the call that settles the record
// has until the lease's local end; should the store not confirm it
// by then, Do returns ErrUnavailable at that moment without waiting for the
// call.
// The outcome may then be stored or not: a retry finds out which. If storing
// the outcome fails, Do returns ErrFenced or ErrUnavailable and no Response:
// the caller must not report success it could not record.
func (g *Guard) Do(ctx context.Context, k Key, fp Fingerprint, fn func(ctx context.Context) (Response, error)) (Result, error) {
	cs := g.newCall("", "")
	return g.call(ctx, k, fp, fn, &cs)
}

// call is Do for every transport, told of the call by cs: the HTTP method
// and route for the Observer, and failOpen, which runs the operation
// unguarded when the store could not be asked to claim the key (see
// mayFailOpen).
func (g *Guard) call(ctx context.Context, k Key, fp Fingerprint, fn func(ctx context.Context) (Response, error), cs *callState) (Result, error) {
	ctx, end := g.startPhase(ctx, PhaseCall, PhaseStart{Scope: k.Scope})
	res, err := g.do(ctx, k, fp, fn, cs)
	if cs.failOpen != nil && mayFailOpen(ctx, cs, err) {
		cs.decided = OutcomeFailedOpen
		cs.failOpen()
	}
	g.report(ctx, k.Scope, cs, res, err)
	end(err)
	return res, err
}

// mayFailOpen reports that a call that failed with err may run its operation
// unguarded: the store could not be asked to claim the key, and nothing ran.
// Never when the record is known to be in flight elsewhere or was claimed
// by this call too late to act on, nor when the caller has gone, for then
// the store's failure may be the cancelled call's doing.
func mayFailOpen(ctx context.Context, cs *callState, err error) bool {
	return !cs.owned && errors.Is(err, ErrUnavailable) && !errors.Is(err, ErrInFlight) && !errors.Is(err, errLateClaim) &&
		ctx.Err() == nil
}

// do is Do, telling cs what its Observer will want to know.
func (g *Guard) do(ctx context.Context, k Key, fp Fingerprint, fn func(ctx context.Context) (Response, error), cs *callState) (Result, error) {
	if err := k.Validate(); err != nil {
		return Result{}, err
	}
	if t, ok := g.store.(Transactor); ok {
		return g.transact(ctx, t, k, fp, fn, cs)
	}
	c, sent, err := g.claim(ctx, k, fp, cs)
	if err != nil {
		return Result{}, err
	}
	if c.State == Completed {
		return Result{Response: c.Response, Replayed: true, OperationID: c.OperationID}, nil
	}
	if err := g.refuseExpired(ctx, k, c, cs); err != nil {
		return Result{}, err
	}
	if c.Attempt > 1 {
		g.observe(ctx, Event{Kind: EventTakeover, Scope: k.Scope, Attempt: c.Attempt, Abandoned: c.Abandoned})
	}
	o, err := g.own(ctx, k, c, sent)
	if err != nil {
		cs.op = OpClaim
		return Result{}, err
	}
	cs.owned, cs.attempt = true, c.Attempt
	res, err := o.run(fn)
	cs.disposition, cs.recovered, cs.unknown = o.cs.disposition, o.cs.recovered, o.cs.unknown
	if o.cs.op != "" {
		cs.op = o.cs.op
	}
	return res, err
}

// refuseExpired refuses a claim that made the record of a key made longer
// ago than the retention: its first attempt's record, if it had one, is
// gone, so the operation may have run. The new record is given back as it
// was found: absent.
func (g *Guard) refuseExpired(ctx context.Context, k Key, c Claim, cs *callState) error {
	if c.Attempt != 1 {
		return nil
	}
	err := g.expiredKey(cs)
	if err != nil {
		bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), g.opts.Lease)
		defer cancel()
		_ = giveBack(bctx, g.store, k, c) // a record left behind is taken over after its lease
	}
	return err
}

// expiredKey is the one rule for a key's age: a key the transport says was
// made longer ago than the retention is refused (ErrKeyExpired), and the
// call is counted as rejected; nil for any other, or one of unknown age.
func (g *Guard) expiredKey(cs *callState) error {
	age := time.Since(cs.keyMade)
	if cs.keyMade.IsZero() || age <= g.opts.Retention {
		return nil
	}
	cs.decided = OutcomeRejected
	return fmt.Errorf("%w: made %v ago, retention %v", ErrKeyExpired, age.Round(time.Second), g.opts.Retention)
}

// claim claims k, waiting while another owner holds it, until the caller owns
// the record or there is a final answer. sent is when the claim that gave
// that answer was handed to the store: an owner's lease is counted from it.
func (g *Guard) claim(ctx context.Context, k Key, fp Fingerprint, cs *callState) (Claim, time.Time, error) {
	req := ClaimRequest{Key: k, Fingerprint: fp, OperationID: newOperationID(), Lease: g.opts.Lease, Retention: g.opts.Retention}
	sent := time.Now()
	cctx, endClaim := g.startPhase(ctx, PhaseClaim, PhaseStart{Scope: k.Scope})
	c, err := g.claimOnce(cctx, req)
	endClaim(err)
	switch {
	case err != nil:
		cs.op = OpClaim
		return c, sent, err
	case c.State == Mismatch:
		return g.rematch(ctx, k, c, sent, cs)
	case c.State == InFlight:
		return g.wait(ctx, req, cs)
	}
	return c, sent, nil
}

// rematcher fingerprints a request under the rules other instances of the
// service may use: another release's, other FingerprintHeaders.
type rematcher interface {
	otherFingerprints() []Fingerprint
}

// rematch claims k again under each of the request's other fingerprints,
// after a claim c, sent at sent, found a record of another: a retry that
// reaches an instance whose fingerprint rules differ from those of the one
// that made the record is matched by the rules it was made with. Only a
// request no rules match fails with ErrMismatch.
func (g *Guard) rematch(ctx context.Context, k Key, c Claim, sent time.Time, cs *callState) (Claim, time.Time, error) {
	err := tryOthers(cs, func(fp Fingerprint) (err error) {
		c, sent, err = g.claim(ctx, k, fp, cs)
		return err
	})
	return c, sent, err
}

// tryOthers calls try with each of the request's other fingerprints
// (cs.others), after a try with its own found a record of another request,
// until one finds none: its error, or ErrMismatch when every one did. The
// tries answer for themselves: they rematch no further.
func tryOthers(cs *callState, try func(fp Fingerprint) error) error {
	others := cs.others
	cs.others = nil
	if others == nil {
		return ErrMismatch
	}
	for _, fp := range others.otherFingerprints() {
		if err := try(fp); !errors.Is(err, ErrMismatch) {
			return err
		}
	}
	return ErrMismatch
}

// claimOnce makes one claim, bounded by Options.ClaimTimeout.
func (g *Guard) claimOnce(ctx context.Context, req ClaimRequest) (Claim, error) {
	bctx, cancel := g.bounded(ctx)
	c, err := g.store.Claim(bctx, req)
	cancel()
	return c, g.cutOff(ctx, bctx, "claim", err)
}

// bounded returns ctx ended after Options.ClaimTimeout, for a claim or a
// subscription. A context that ends sooner anyway is returned as it is: the
// bound costs five allocations a call.
func (g *Guard) bounded(ctx context.Context) (context.Context, context.CancelFunc) {
	if d, ok := ctx.Deadline(); g.opts.ClaimTimeout < 0 || ok && time.Until(d) <= g.opts.ClaimTimeout {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, g.opts.ClaimTimeout)
}

// cutOff is err, from a call on bctx made by bounded from ctx: a call cut
// off by that bound while ctx still runs fails with ErrUnavailable, since
// the caller is waiting and the store is not answering. Any other error is
// the store's own, kept as it is (bctx may be cancelled by now: only its
// deadline counts).
func (g *Guard) cutOff(ctx, bctx context.Context, what string, err error) error {
	if err != nil && ctx.Err() == nil && errors.Is(bctx.Err(), context.DeadlineExceeded) {
		return fmt.Errorf("%w: %s %w (%v): %w", ErrUnavailable, what, errCutOff, g.opts.ClaimTimeout, err)
	}
	return err
}

// errCutOff marks a call that Options.ClaimTimeout cut off.
var errCutOff = errors.New("unanswered within Options.ClaimTimeout")

// Info describes the attempt that is running an operation; fn and HTTP
// handlers get it with FromContext.
type Info struct {
	// OperationID is made at the record's first claim and kept for its
	// whole life: every attempt at one operation shares it.
	OperationID string
	// Attempt counts the claims that became owners, from 1.
	Attempt int
	// Token is this attempt's fencing token. Tokens grow with every claim of
	// a key, so a database that remembers the highest token it has seen can
	// refuse writes from an owner that was taken over.
	Token uint64
	// Takeover reports that an earlier attempt did not finish (it crashed,
	// stalled past its lease, or failed): its side effects may have happened.
	Takeover bool
	// Abandoned reports that the previous attempt's lease ran out before it
	// settled the record (it crashed or stalled), as opposed to failing and
	// releasing the key: ask the downstream service what became of
	// DownstreamKey before acting again.
	Abandoned bool

	owner *owner // the attempt's hold on the record
	early bool   // the operation may settle early (see settleEarly)
	// settled: the operation settled early. Written and read on the
	// operation's goroutine only.
	settled bool

	mu        sync.Mutex
	set       bool // SetDisposition was called: the default no longer applies
	chosen    Disposition
	completed *Response // what CompleteOutside stored; nil until then
	finishing bool      // a CompleteOutside is under way
}

// settleEarly settles the record with resp while the operation still runs,
// as the middleware does before streaming a response too large to buffer.
// The operation's later return then settles nothing. It is there only for
// an operation run by Guard.Do (not for Options.Recover).
func (i *Info) settleEarly(resp Response) error {
	if i.oneCommit() {
		// Nothing may reach the client before the transaction commits: the
		// middleware answers 503 and the store rolls back.
		return fmt.Errorf("%w: a response over MaxResponseBytes cannot be streamed before the one-commit mode's commit", ErrUnavailable)
	}
	if !i.early {
		return errors.New("idempotency: no early settlement here")
	}
	if err := i.owner.settle(resp, i.disposition()); err != nil {
		return err
	}
	i.settled = true
	return nil
}

type infoKey struct{}

// FromContext returns the Info of the attempt running in ctx, or false when
// ctx does not come from Guard.Do or the middleware.
func FromContext(ctx context.Context) (*Info, bool) {
	i, ok := ctx.Value(infoKey{}).(*Info)
	return i, ok
}

// DownstreamKey derives, from the operation ID in ctx, an idempotency key to
// send to a downstream service (a payment provider) under the given name. It
// is the same for every attempt of the operation, so a takeover that repeats
// the downstream call gets the provider's original result instead of a
// second effect. It fails with ErrNoOperation when ctx carries no operation
// (a handler mounted without the middleware, say): a call made without the
// key would not be deduplicated.
func DownstreamKey(ctx context.Context, name string) (string, error) {
	i, ok := FromContext(ctx)
	if !ok {
		return "", fmt.Errorf("%w: no downstream key %q", ErrNoOperation, name)
	}
	sum := sha256.Sum256([]byte(i.OperationID + "\x00" + name))
	return "idem_" + b32.EncodeToString(sum[:20]), nil
}

// SetDisposition chooses what becomes of the record when the operation in
// ctx returns without an error, overriding the default (Keep for Guard.Do,
// the status policy for the middleware). A Forget chosen here releases the
// record instead once the operation may have had an effect (see Forget).
// It reports false, and changes nothing, when ctx carries no operation or
// d is not Keep, Release, Forget or Settled.
func SetDisposition(ctx context.Context, d Disposition) bool {
	i, ok := FromContext(ctx)
	if !ok || d < Keep || d > Settled {
		return false
	}
	i.mu.Lock()
	i.set, i.chosen = true, d
	i.mu.Unlock()
	return true
}

// outcome is the response and disposition of an operation that returned
// resp without an error, once its default disposition was chosen: the
// response CompleteOutside stored, when the operation kept it.
func (i *Info) outcome(resp Response) (Response, Disposition) {
	i.mu.Lock()
	defer i.mu.Unlock()
	if i.keptCompletionLocked() {
		return *i.completed, Settled
	}
	return resp, i.chosen
}

// completedOutside reports that the operation's outcome is the response
// CompleteOutside stored.
func (i *Info) completedOutside() bool {
	i.mu.Lock()
	defer i.mu.Unlock()
	return i.keptCompletionLocked()
}

func (i *Info) keptCompletionLocked() bool {
	return i.completed != nil && (i.chosen == Keep || i.chosen == Settled)
}

// SetDefaultDisposition chooses d for the operation in ctx unless it chose
// for itself with SetDisposition. It is for the adapter of a transport
// that maps an operation's outcome (an HTTP status, a gRPC code) to a
// Disposition after the operation returned, as the middleware does, so
// that the operation's own choice still wins. It reports false, and
// changes nothing, when ctx carries no operation or d is not Keep,
// Release, Forget or Settled.
func SetDefaultDisposition(ctx context.Context, d Disposition) bool {
	i, ok := FromContext(ctx)
	if !ok || d < Keep || d > Settled {
		return false
	}
	i.defaultTo(d)
	return true
}

// defaultTo chooses d unless the operation chose for itself.
func (i *Info) defaultTo(d Disposition) {
	i.mu.Lock()
	if !i.set {
		i.chosen = d
	}
	i.mu.Unlock()
}

func (i *Info) disposition() Disposition {
	i.mu.Lock()
	defer i.mu.Unlock()
	return i.chosen
}

var b32 = base32.StdEncoding.WithPadding(base32.NoPadding)

// newOperationID returns 128 random bits; a collision would merge two
// operations' downstream keys, so they must not be guessable or repeat.
func newOperationID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // never fails: see crypto/rand.Read
	var id [3 + 26]byte    // "op_" and b in base32: one allocation, the string's
	b32.Encode(id[copy(id[:], "op_"):], b[:])
	return string(id[:])
}
