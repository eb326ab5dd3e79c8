package idempotency

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/storeerr"
)

// recorder of events, for the tests: each event as one short line, in order.
type events struct {
	mu  sync.Mutex
	all []Event
}

func (r *events) Observe(_ context.Context, e Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.all = append(r.all, e)
}

// lines renders the events' kinds, outcomes and the fields a case checks.
func (r *events) lines() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, e := range r.all {
		s := e.Kind.String()
		switch e.Kind {
		case EventOutcome:
			s += " " + e.Outcome.String()
		case EventTakeover:
			s += fmt.Sprintf(" attempt=%d abandoned=%v", e.Attempt, e.Abandoned)
		case EventSweep:
			s += fmt.Sprintf(" found=%d settled=%d left=%d", e.Found, e.Settled, e.Left)
		}
		if e.Op != "" {
			s += " op=" + e.Op
		}
		if e.Method != "" {
			s += " " + e.Method + " " + e.Route
		}
		out = append(out, s)
	}
	return out
}

func (r *events) last() Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.all[len(r.all)-1]
}

func ok201(context.Context) (Response, error) { return Response{Status: 201}, nil }

// TestObserverSequences drives scripted runs through Do and asserts the
// exact events each reports.
func TestObserverSequences(t *testing.T) {
	ctx := context.Background()
	fp := FingerprintOf("charge", []byte(`{"amount":1}`))
	k := func(t *testing.T) Key { return Key{Scope: "acct_1", Name: t.Name()} }
	guard := func(s Store, o Options) (*Guard, *events) {
		ev := &events{}
		o.Observer = ev
		return New(s, o), ev
	}

	t.Run("ExecutedThenReplayed", func(t *testing.T) {
		g, ev := guard(NewMemoryStore(MemoryOptions{}), Options{})
		_, err := g.Do(ctx, k(t), fp, ok201)
		require.NoError(t, err)
		first := ev.last()
		assert.Equal(t, "acct_1", first.Scope)
		assert.Equal(t, 1, first.Attempt)
		assert.Positive(t, first.Duration)
		_, err = g.Do(ctx, k(t), fp, ok201)
		require.NoError(t, err)
		assert.Equal(t, []string{"outcome executed", "outcome replayed"}, ev.lines())
	})

	t.Run("WaitedThenReplayed", func(t *testing.T) {
		s := NewMemoryStore(MemoryOptions{})
		owner, ownerEv := guard(s, Options{})
		dup, dupEv := guard(s, Options{})
		started, finish := make(chan struct{}), make(chan struct{})
		done := make(chan error, 1)
		go func() {
			_, err := owner.Do(ctx, k(t), fp, func(context.Context) (Response, error) {
				close(started)
				<-finish
				return Response{Status: 201}, nil
			})
			done <- err
		}()
		<-started
		time.AfterFunc(50*time.Millisecond, func() { close(finish) })
		r, err := dup.Do(ctx, k(t), fp, ok201)
		require.NoError(t, err)
		require.NoError(t, <-done)
		assert.True(t, r.Replayed)
		assert.Equal(t, []string{"outcome executed"}, ownerEv.lines())
		assert.Equal(t, []string{"outcome waited_replayed"}, dupEv.lines())
		assert.GreaterOrEqual(t, dupEv.last().Waited, 40*time.Millisecond)
	})

	t.Run("TakeoverAfterKill", func(t *testing.T) {
		s := NewMemoryStore(MemoryOptions{})
		// An owner that claimed and died: nothing renews its lease.
		_, err := s.Claim(ctx, ClaimRequest{Key: k(t), Fingerprint: fp, OperationID: "op-dead", Lease: 100 * time.Millisecond, Retention: time.Hour})
		require.NoError(t, err)
		g, ev := guard(s, Options{})
		_, err = g.Do(ctx, k(t), fp, ok201)
		require.NoError(t, err)
		assert.Equal(t, []string{"takeover attempt=2 abandoned=true", "outcome waited_owner"}, ev.lines())
		assert.Equal(t, 2, ev.last().Attempt)
	})

	t.Run("Recovered", func(t *testing.T) {
		s := NewMemoryStore(MemoryOptions{})
		_, err := s.Claim(ctx, ClaimRequest{Key: k(t), Fingerprint: fp, OperationID: "op-dead", Lease: 10 * time.Millisecond, Retention: time.Hour})
		require.NoError(t, err)
		time.Sleep(20 * time.Millisecond)
		g, ev := guard(s, Options{Recover: func(context.Context) (Response, error) { return Response{Status: 201}, nil }})
		r, err := g.Do(ctx, k(t), fp, func(context.Context) (Response, error) {
			t.Error("the operation ran beside its recovery")
			return Response{}, nil
		})
		require.NoError(t, err)
		assert.True(t, r.Replayed)
		assert.Equal(t, []string{"takeover attempt=2 abandoned=true", "outcome recovered"}, ev.lines())
	})

	t.Run("RecoveryUnknown", func(t *testing.T) {
		s := NewMemoryStore(MemoryOptions{})
		_, err := s.Claim(ctx, ClaimRequest{Key: k(t), Fingerprint: fp, OperationID: "op-dead", Lease: 10 * time.Millisecond, Retention: time.Hour})
		require.NoError(t, err)
		time.Sleep(20 * time.Millisecond)
		g, ev := guard(s, Options{Recover: func(context.Context) (Response, error) { return Response{}, ErrUnknown }})
		_, err = g.Do(ctx, k(t), fp, ok201)
		require.ErrorIs(t, err, ErrInFlight)
		assert.Equal(t, []string{"takeover attempt=2 abandoned=true", "outcome recovery_unknown"}, ev.lines())
	})

	t.Run("FencedByRefusedRenewal", func(t *testing.T) {
		fs := &faultStore{Store: NewMemoryStore(MemoryOptions{}), hook: func(_ context.Context, op string) error {
			if op == "heartbeat" {
				return ErrFenced
			}
			return nil
		}}
		g, ev := guard(fs, Options{Lease: 300 * time.Millisecond})
		_, err := g.Do(ctx, k(t), fp, func(ctx context.Context) (Response, error) {
			<-ctx.Done()
			return Response{}, context.Cause(ctx)
		})
		require.ErrorIs(t, err, ErrFenced)
		assert.Equal(t, []string{"renewal op=renew", "outcome fenced"}, ev.lines())
	})

	t.Run("RenewalsBetweenOutcomes", func(t *testing.T) {
		g, ev := guard(NewMemoryStore(MemoryOptions{}), Options{Lease: 300 * time.Millisecond})
		_, err := g.Do(ctx, k(t), fp, func(context.Context) (Response, error) {
			time.Sleep(250 * time.Millisecond) // two renewals, at 100 and 200ms
			return Response{Status: 201}, nil
		})
		require.NoError(t, err)
		// Two renewals on an idle machine; a late timer may add one.
		lines := ev.lines()
		require.GreaterOrEqual(t, len(lines), 3, "%q", lines)
		assert.Equal(t, "outcome executed", lines[len(lines)-1])
		for _, l := range lines[:len(lines)-1] {
			assert.Equal(t, "renewal", l)
		}
	})

	t.Run("StoreOutage", func(t *testing.T) {
		for _, op := range []string{"claim", "complete", "release", "forget"} {
			fs := &faultStore{Store: NewMemoryStore(MemoryOptions{}), hook: func(_ context.Context, called string) error {
				if called == op {
					return storeerr.Unavailable(op, errors.New("connection refused"))
				}
				return nil
			}}
			g, ev := guard(fs, Options{})
			_, err := g.Do(ctx, Key{Name: op}, fp, func(ctx context.Context) (Response, error) {
				switch op {
				case "release":
					return Response{}, errors.New("declined")
				case "forget":
					SetDisposition(ctx, Forget)
				}
				return Response{Status: 201}, nil
			})
			require.ErrorIs(t, err, ErrUnavailable, op)
			assert.Equal(t, []string{"outcome unavailable op=" + op}, ev.lines(), op)
		}
	})

	t.Run("SubscribeOutage", func(t *testing.T) {
		s := NewMemoryStore(MemoryOptions{})
		_, err := s.Claim(ctx, ClaimRequest{Key: k(t), Fingerprint: fp, OperationID: "op-live", Lease: time.Hour, Retention: time.Hour})
		require.NoError(t, err)
		// The subscription is tried again until the wait ends.
		g, ev := guard(&subscribeFails{s}, Options{WaitTimeout: 200 * time.Millisecond})
		_, err = g.Do(ctx, k(t), fp, ok201)
		require.ErrorIs(t, err, ErrUnavailable)
		require.ErrorIs(t, err, ErrInFlight)
		assert.Equal(t, []string{"outcome unavailable op=subscribe"}, ev.lines())
	})

	t.Run("ReleasedAndForgotten", func(t *testing.T) {
		g, ev := guard(NewMemoryStore(MemoryOptions{}), Options{})
		_, err := g.Do(ctx, Key{Name: "fails"}, fp, func(context.Context) (Response, error) { return Response{}, errors.New("declined") })
		require.Error(t, err)
		_, err = g.Do(ctx, Key{Name: "forgets"}, fp, func(ctx context.Context) (Response, error) {
			SetDisposition(ctx, Forget)
			return Response{Status: 400}, nil
		})
		require.NoError(t, err)
		assert.Equal(t, []string{"outcome released", "outcome forgotten"}, ev.lines())
	})

	t.Run("Refusals", func(t *testing.T) {
		s := NewMemoryStore(MemoryOptions{})
		_, err := s.Claim(ctx, ClaimRequest{Key: Key{Name: "live"}, Fingerprint: fp, OperationID: "op-live", Lease: time.Hour, Retention: time.Hour})
		require.NoError(t, err)
		g, ev := guard(s, Options{WaitTimeout: -1})
		_, err = g.Do(ctx, Key{Name: "live"}, fp, ok201)
		require.ErrorIs(t, err, ErrInFlight)
		_, err = g.Do(ctx, Key{Name: "live"}, FingerprintOf("other", nil), ok201)
		require.ErrorIs(t, err, ErrMismatch)
		_, err = g.Do(ctx, Key{Name: "bad key"}, fp, ok201)
		require.ErrorIs(t, err, ErrInvalidKey)
		assert.Equal(t, []string{"outcome in_flight", "outcome mismatch", "outcome invalid_key"}, ev.lines())
	})

	// A waiting duplicate whose client leaves is no store outage.
	t.Run("ClientGoneWhileWaiting", func(t *testing.T) {
		s := NewMemoryStore(MemoryOptions{})
		_, err := s.Claim(ctx, ClaimRequest{Key: k(t), Fingerprint: fp, OperationID: "op-live", Lease: time.Hour, Retention: time.Hour})
		require.NoError(t, err)
		g, ev := guard(s, Options{})
		cctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		defer cancel()
		_, err = g.Do(cctx, k(t), fp, ok201)
		require.Error(t, err)
		assert.Equal(t, []string{"outcome client_gone"}, ev.lines())
	})

	t.Run("Sweep", func(t *testing.T) {
		s := NewMemoryStore(MemoryOptions{})
		for _, name := range []string{"a", "b"} {
			_, err := s.Claim(ctx, ClaimRequest{Key: Key{Name: name}, Fingerprint: fp, OperationID: "op-" + name, Lease: time.Millisecond, Retention: time.Hour})
			require.NoError(t, err)
		}
		time.Sleep(10 * time.Millisecond)
		g, ev := guard(s, Options{Recover: func(ctx context.Context) (Response, error) {
			if i, _ := FromContext(ctx); i.OperationID == "op-b" {
				return Response{}, ErrUnknown
			}
			return Response{Status: 201}, nil
		}})
		n, err := g.Sweep(ctx, 10)
		require.NoError(t, err)
		assert.Equal(t, 1, n)
		assert.Equal(t, []string{"sweep found=2 settled=1 left=1"}, ev.lines())
	})
}

// subscribeFails is a store whose subscriptions fail.
type subscribeFails struct{ Store }

func (s *subscribeFails) Subscribe(context.Context, Key) (Subscription, error) {
	return nil, storeerr.Unavailable("subscribe", errors.New("connection refused"))
}

// The middleware reports each request once, with its method and route: a
// request run unguarded is failed_open, not also unavailable.
func TestObserverMiddleware(t *testing.T) {
	ev := &events{}
	fs := &faultStore{Store: NewMemoryStore(MemoryOptions{}), hook: func(_ context.Context, op string) error {
		if op == "claim" {
			return storeerr.Unavailable("claim", errors.New("connection refused"))
		}
		return nil
	}}
	mux := http.NewServeMux()
	mux.Handle("POST /charges", New(fs, Options{Observer: ev}).Middleware(MiddlewareOptions{Scope: SingleTenant, FailOpen: true})(
		http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(201) })))
	rr := serve(mux, keyed("k", `{}`))
	assert.Equal(t, 201, rr.Code)

	ok := NewMemoryStore(MemoryOptions{})
	mux2 := http.NewServeMux()
	mux2.Handle("POST /charges", New(ok, Options{Observer: ev}).Middleware(MiddlewareOptions{Scope: SingleTenant})(
		http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(201) })))
	serve(mux2, keyed("k", `{}`))
	serve(mux2, keyed("k", `{}`))
	serve(mux2, keyed("", `{}`))
	serve(mux2, keyed("k", strings.Repeat("x", 2<<20)))
	assert.Equal(t, []string{
		"outcome failed_open op=claim POST POST /charges",
		"outcome executed POST POST /charges",
		"outcome replayed POST POST /charges",
		"outcome invalid_key POST POST /charges",
		"outcome rejected POST POST /charges",
	}, ev.lines())
}

// SlogObserver logs at the level of what an operator must do.
func TestSlogObserver(t *testing.T) {
	var buf bytes.Buffer
	o := SlogObserver(slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug})))
	for _, e := range []Event{
		{Kind: EventOutcome, Outcome: OutcomeReplayed, Scope: "acct_1", Method: "POST", Route: "POST /charges", Duration: time.Millisecond},
		{Kind: EventOutcome, Outcome: OutcomeFenced, Scope: "acct_1", Attempt: 2, Err: ErrFenced},
		{Kind: EventOutcome, Outcome: OutcomeUnavailable, Scope: "acct_1", Op: OpClaim, Err: ErrUnavailable},
		{Kind: EventOutcome, Outcome: OutcomeMismatch, Scope: "acct_1"},
		{Kind: EventRenewal, Scope: "acct_1", Attempt: 1, Duration: time.Millisecond},
		{Kind: EventSweep, Found: 3, Settled: 2, Left: 1},
	} {
		o.Observe(context.Background(), e)
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	require.Len(t, lines, 6)
	for i, want := range []string{
		`level=DEBUG msg="idempotency outcome" outcome=replayed scope=acct_1 method=POST route="POST /charges" duration=1ms`,
		`level=WARN msg="idempotency outcome" outcome=fenced scope=acct_1 attempt=2 err="idempotency: fenced off: no longer the owner"`,
		`level=ERROR msg="idempotency outcome" outcome=unavailable scope=acct_1 op=claim err="idempotency: store unavailable"`,
		`level=INFO msg="idempotency outcome" outcome=mismatch scope=acct_1`,
		`level=DEBUG msg="idempotency renewal" scope=acct_1 attempt=1 duration=1ms`,
		`level=INFO msg="idempotency sweep" scope="" found=3 settled=2 left=1`,
	} {
		assert.Contains(t, lines[i], want)
	}
}

// phases records the phases a PhaseObserver is told of, and the events, in
// order; each phase's context carries its name.
type phases struct {
	events
	mu    sync.Mutex
	order []string
}

type phaseKey struct{}

func (p *phases) log(s string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.order = append(p.order, s)
}

func (p *phases) Observe(ctx context.Context, e Event) {
	in, _ := ctx.Value(phaseKey{}).(string)
	if e.Kind == EventOutcome {
		p.log("outcome " + e.Outcome.String() + " in " + in)
	}
	p.events.Observe(ctx, e)
}

func (p *phases) StartPhase(ctx context.Context, ph Phase, s PhaseStart) (context.Context, func(error)) {
	in, _ := ctx.Value(phaseKey{}).(string)
	start := fmt.Sprintf("start %v in %q", ph, in)
	if s.Attempt > 0 {
		start += fmt.Sprintf(" attempt=%d token>0=%v", s.Attempt, s.Token > 0)
	}
	p.log(start)
	ended := false
	return context.WithValue(ctx, phaseKey{}, ph.String()), func(err error) {
		if ended {
			p.log(fmt.Sprintf("end %v again", ph))
		}
		ended = true
		p.log(fmt.Sprintf("end %v err=%v", ph, err != nil))
	}
}

// A PhaseObserver sees each phase of a call begin and end, nested in the
// call's, and the operation runs in its run phase's context.
func TestPhaseObserver(t *testing.T) {
	ctx := context.Background()
	fp := FingerprintOf("charge", nil)
	p := &phases{}
	s := NewMemoryStore(MemoryOptions{})
	g := New(s, Options{Observer: p})
	_, err := g.Do(ctx, Key{Name: "new"}, fp, func(ctx context.Context) (Response, error) {
		in, _ := ctx.Value(phaseKey{}).(string)
		p.log("operation in " + in)
		return Response{Status: 201}, nil
	})
	require.NoError(t, err)
	assert.Equal(t, []string{
		`start call in ""`,
		`start claim in "call"`, `end claim err=false`,
		`start run in "call" attempt=1 token>0=true`, `operation in run`, `end run err=false`,
		`start settle in "call" attempt=1 token>0=true`, `end settle err=false`,
		`outcome executed in call`,
		`end call err=false`,
	}, p.order)

	// A duplicate that waits for a live original, in vain.
	_, err = s.Claim(ctx, ClaimRequest{Key: Key{Name: "live"}, Fingerprint: fp, OperationID: "op-live", Lease: time.Hour, Retention: time.Hour})
	require.NoError(t, err)
	p.order = nil
	g = New(s, Options{Observer: p, WaitTimeout: 20 * time.Millisecond})
	_, err = g.Do(ctx, Key{Name: "live"}, fp, ok201)
	require.ErrorIs(t, err, ErrInFlight)
	assert.Equal(t, []string{
		`start call in ""`,
		`start claim in "call"`, `end claim err=false`,
		`start wait in "call"`, `end wait err=true`,
		`outcome in_flight in call`,
		`end call err=true`,
	}, p.order)
}
