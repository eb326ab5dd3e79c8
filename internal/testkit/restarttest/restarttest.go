// Package restarttest kills a store's server under load and starts it again
// on the same address and data. It checks, for every store, that
// calls fail closed while the server is down and that the same Guards, on
// the same clients, succeed once it is back; it counts what the restart
// lost. For a server that keeps every write it acknowledged it also checks
// that nothing was lost: every answered operation replays its exact
// response, none runs twice, tokens keep growing on every key, and a
// waiter subscribed across the restart is woken and answered.
//
// The Redis and PostgreSQL tests share it; each brings a Rig.
package restarttest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/testkit/report"
)

const (
	// workers call Do at once, spread over guards Guards; each key is asked
	// for by callers callers, which the workers take in turn, so most
	// duplicates overlap their original.
	workers, guards, callers = 16, 3, 3
	// answeredBefore keys are answered before the kill; answeredAfter more
	// after the restart before the load stops.
	answeredBefore, answeredAfter = 150, 150
	// tokenKeys are claimed and released again and again, so that every
	// one of them is claimed on both sides of the restart.
	tokenKeys = 8
	// lease is the load's: a record the kill left in flight is taken over
	// soon after the restart.
	lease = time.Second
	// minDowntime keeps the server down long enough for the load to meet it.
	minDowntime = 200 * time.Millisecond
	// hang bounds every wait, only to catch a hang.
	hang = 30 * time.Second
	// heldLease outlasts the restart, and waiterTimeout fails a waiter that
	// nothing woke long before the lease could end its wait. Both are long
	// because a call to a Redis server that is down can take seconds to
	// fail (go-redis redials and retries), and the server stays down that
	// long.
	heldLease, waiterTimeout = time.Minute, 40 * time.Second
)

// Rig is a store whose server a test can kill and start again.
type Rig struct {
	// Name is the store's name in the report, e.g. "redis-everysec".
	Name string
	// Fault is the kind of fault Kill injects, for the report: "kill",
	// "immediate-shutdown".
	Fault string
	// Store is shared by every Guard of the run, as by the instances of a
	// service.
	Store idempotency.Store
	// Kill stops the server abruptly: no shutdown, connections reset.
	Kill func(t *testing.T)
	// Start starts it again on the same address and data, and returns once
	// it answers.
	Start func(t *testing.T)
	// Durable says the server keeps every write it acknowledged across Kill
	// and Start. Run then asserts that nothing was lost, and holds an
	// operation and a waiter for it across the restart (a store that forgot
	// the record would run it twice).
	Durable bool
}

// counts is what a run counted.
type counts struct {
	// Operations counts the calls of Do; Duplicates those on a key that an
	// earlier call used.
	Operations, Duplicates int
	// Refused counts the calls that failed closed (ErrUnavailable,
	// ErrInFlight, ErrFenced), and were retried.
	Refused int
	// Answered counts the keys answered with a completed response,
	// AnsweredBeforeKill those answered before the kill.
	Answered, AnsweredBeforeKill int
	// Lost counts the answered keys that a later call did not replay: it
	// got another response, or the operation ran again. LostBeforeKill
	// counts those answered before the kill.
	Lost, LostBeforeKill int
	// RerunsAfterAnswer counts the runs of an operation whose key had been
	// answered already.
	RerunsAfterAnswer int
	// Overlaps counts the runs that started while another run of the key
	// had not returned.
	Overlaps int
	// Remade counts the runs of a key already run whose record was made
	// anew (attempt 1): the store had forgotten the earlier claim.
	Remade int
	// Abandoned counts the takeovers of a record whose owner's settle the
	// kill cut off (Abandoned set): the crash window, which Recover and
	// DownstreamKey cover.
	Abandoned int
	// TokensCompared counts the claims after the restart on a key claimed
	// before the kill; TokenRegressions those whose token was not above
	// every token the key had before.
	TokensCompared, TokenRegressions int
	// Downtime is how long the server was down, Start included; FailedIn
	// how long a call made while it was down took to fail.
	Downtime, FailedIn time.Duration
	// Waiter says what became of the waiter held across the restart of a
	// durable store.
	Waiter string
}

// Run loads rig's store from several Guards, kills its server, starts it
// again, and checks, logs and reports what it saw (see the package
// comment).
func Run(t *testing.T, rig Rig) {
	h := &history{runs: map[idempotency.Key]int{}, running: map[idempotency.Key]int{},
		answers: map[idempotency.Key]answer{}, lost: map[idempotency.Key]bool{}, keys: map[idempotency.Key]bool{},
		before: map[idempotency.Key]uint64{}, tokens: map[idempotency.Key]uint64{}, tokensAfter: map[idempotency.Key]bool{}}
	gs := make([]*idempotency.Guard, guards)
	for i := range gs {
		gs[i] = idempotency.New(rig.Store, idempotency.Options{Lease: lease})
	}

	ctx, cancel := context.WithCancel(context.Background())
	var load, tokenLoop sync.WaitGroup
	defer func() {
		cancel()
		load.Wait()
		tokenLoop.Wait()
	}()
	reqs := make(chan request)
	stop := make(chan struct{})
	load.Go(func() {
		defer close(reqs)
		for i := 0; ; i++ {
			k := idempotency.Key{Scope: "restart", Name: fmt.Sprintf("op-%d", i)}
			for c := range callers {
				select {
				case reqs <- request{k: k, g: gs[(i+c)%guards]}:
				case <-stop:
					return
				}
			}
		}
	})
	for range workers {
		load.Go(func() {
			for r := range reqs {
				h.call(ctx, t, r.g, r.k, idempotency.Keep)
			}
		})
	}
	tokenLoop.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			k := idempotency.Key{Scope: "restart", Name: fmt.Sprintf("token-%d", i%tokenKeys)}
			h.call(ctx, t, gs[i%guards], k, idempotency.Release)
		}
	})

	waitFor(t, "keys answered before the kill", func() bool { return h.answered() >= answeredBefore })
	var held *held
	if rig.Durable {
		held = hold(ctx, t, rig.Store, h)
	}
	h.kill()
	killed := time.Now()
	rig.Kill(t)

	// The same Guard that served the load, on the same client, fails
	// closed: the operation does not run.
	ran := false
	probed := time.Now()
	_, err := gs[0].Do(ctx, idempotency.Key{Scope: "restart", Name: "while-down"}, fingerprint, func(context.Context) (idempotency.Response, error) {
		ran = true
		return idempotency.Response{Status: http.StatusCreated}, nil
	})
	failedIn := time.Since(probed)
	h.ops.Add(1)
	if !errors.Is(err, idempotency.ErrUnavailable) || ran {
		t.Errorf("a call while the server is down: %v, operation run: %v; want ErrUnavailable, not run", err, ran)
	}
	time.Sleep(minDowntime - time.Since(killed))
	rig.Start(t)
	downtime := time.Since(killed)
	answeredAtRestart := h.restarted()

	waitFor(t, "a call to succeed after the restart", func() bool {
		h.ops.Add(1)
		_, err := gs[0].Do(ctx, idempotency.Key{Scope: "restart", Name: "after-restart"}, fingerprint, func(ctx context.Context) (idempotency.Response, error) {
			return idempotency.Response{Status: http.StatusCreated}, nil
		})
		return err == nil
	})
	stranded, waiter := 0, ""
	if held != nil {
		stranded, waiter = held.check(t)
	}
	waitFor(t, "keys answered after the restart, and every token key claimed", func() bool {
		return h.answered() >= answeredAtRestart+answeredAfter && h.tokenKeysAfter() == tokenKeys
	})
	close(stop)
	load.Wait()
	tokenLoop.Wait()

	// Every key once more, through another Guard: the replay must be the
	// first answer's, byte for byte.
	keys := h.allKeys()
	next := make(chan idempotency.Key)
	var verify sync.WaitGroup
	for w := range workers {
		verify.Go(func() {
			for k := range next {
				h.call(ctx, t, gs[(w+1)%guards], k, idempotency.Keep)
			}
		})
	}
	for _, k := range keys {
		next <- k
	}
	close(next)
	verify.Wait()

	o := h.counts()
	o.Downtime, o.FailedIn, o.Waiter = downtime, failedIn, waiter
	t.Logf("%s: %+v", rig.Name, o)
	if rig.Durable {
		if o.Lost != 0 || o.RerunsAfterAnswer != 0 || o.Remade != 0 || o.Overlaps != 0 || o.TokenRegressions != 0 {
			t.Errorf("%s keeps what it acknowledged, yet the restart lost %d completions (%d answered before the kill); operations ran again after their answer %d times, with their record made anew %d times, beside another run %d times; %d of %d tokens went backwards",
				rig.Name, o.Lost, o.LostBeforeKill, o.RerunsAfterAnswer, o.Remade, o.Overlaps, o.TokenRegressions, o.TokensCompared)
		}
		if o.TokensCompared < tokenKeys {
			t.Errorf("only %d claims after the restart on keys claimed before; want at least %d", o.TokensCompared, tokenKeys)
		}
	}
	e := report.Entry{Suite: "restarts", Store: rig.Name, Faults: map[string]int{rig.Fault: 1},
		Operations: o.Operations, Duplicates: o.Duplicates, DoubleExecutions: o.Overlaps,
		StrandedWaiters: stranded, Notes: o.notes()}
	if rig.Durable {
		e.LostCompletions = o.Lost
		e.DoubleExecutions += o.RerunsAfterAnswer + o.Remade
	}
	report.Add(t, e)
}

// notes says what the restart cost, for the report.
func (o counts) notes() string {
	return fmt.Sprintf("down %v, a call failed closed in %v; lost %d of %d completions answered before the kill (%d of %d in all); "+
		"retries of lost keys ran their operation again %d times; %d runs made their record anew after an earlier run; "+
		"%d of %d tokens after the restart went backwards; %d takeovers of records the kill left in flight (Abandoned); %d calls refused",
		o.Downtime.Round(time.Millisecond), o.FailedIn.Round(time.Millisecond), o.LostBeforeKill, o.AnsweredBeforeKill, o.Lost, o.Answered,
		o.RerunsAfterAnswer, o.Remade, o.TokenRegressions, o.TokensCompared, o.Abandoned, o.Refused) + waiterNote(o.Waiter)
}

func waiterNote(how string) string {
	if how == "" {
		return ""
	}
	return "; the waiter across the restart was " + how
}

// fingerprint is every call's: the keys tell the operations apart.
var fingerprint = idempotency.FingerprintOf("restart", nil)

type request struct {
	k idempotency.Key
	g *idempotency.Guard
}

// history is what the calls and the runs of their operations saw.
type history struct {
	ops, refused atomic.Int64

	mu      sync.Mutex
	phase   phase
	keys    map[idempotency.Key]bool // every key called: true if its outcome is kept, to be replayed at the end
	calls   int                      // calls of keys, for the duplicates
	runs    map[idempotency.Key]int
	running map[idempotency.Key]int
	answers map[idempotency.Key]answer
	lost    map[idempotency.Key]bool
	// tokens is the highest token each key's runs had; before, its copy at
	// the kill.
	tokens, before                  map[idempotency.Key]uint64
	tokensAfter                     map[idempotency.Key]bool // token keys claimed after the restart
	reruns, overlaps, remade, aband int
	compared, regressions           int
}

type phase int

const (
	up phase = iota
	down
	restarted
)

type answer struct {
	resp  string
	phase phase
}

// call calls Do for k until it is answered, retrying calls that failed
// closed. The operation settles with d.
func (h *history) call(ctx context.Context, t *testing.T, g *idempotency.Guard, k idempotency.Key, d idempotency.Disposition) {
	h.mu.Lock()
	h.keys[k] = d == idempotency.Keep
	h.mu.Unlock()
	deadline := time.Now().Add(hang)
	for {
		h.ops.Add(1)
		h.mu.Lock()
		h.calls++
		h.mu.Unlock()
		res, err := g.Do(ctx, k, fingerprint, func(ctx context.Context) (idempotency.Response, error) {
			info, _ := idempotency.FromContext(ctx)
			h.start(k, info, d)
			// Long enough for duplicates to wait, and short beside the
			// downtime, so that a run the kill interrupts has returned by
			// the time the server is back.
			time.Sleep(rand.N(5 * time.Millisecond))
			h.end(k)
			idempotency.SetDisposition(ctx, d)
			return response(k, info), nil
		})
		switch {
		case err == nil:
			if d == idempotency.Keep {
				h.answer(k, res.Response)
			}
			return
		case ctx.Err() != nil:
			return
		case !errors.Is(err, idempotency.ErrUnavailable) && !errors.Is(err, idempotency.ErrInFlight) && !errors.Is(err, idempotency.ErrFenced):
			t.Errorf("%v: %v", k, err)
			return
		case time.Now().After(deadline):
			t.Errorf("%v: not answered in %v: %v", k, hang, err)
			return
		}
		h.refused.Add(1)
		time.Sleep(10*time.Millisecond + rand.N(40*time.Millisecond))
	}
}

// response is a run's answer: it tells runs apart, and has every part a
// replay must keep.
func response(k idempotency.Key, info *idempotency.Info) idempotency.Response {
	return idempotency.Response{
		Status: http.StatusCreated,
		Header: http.Header{"Token": {strconv.FormatUint(info.Token, 10)}, "Attempt": {strconv.Itoa(info.Attempt)}},
		Body:   []byte("charged " + k.Name),
	}
}

func render(r idempotency.Response) string {
	return fmt.Sprintf("%d %v %q", r.Status, r.Header, r.Body)
}

func (h *history) start(k idempotency.Key, info *idempotency.Info, d idempotency.Disposition) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.running[k] > 0 {
		h.overlaps++
	}
	h.running[k]++
	if _, ok := h.answers[k]; ok {
		h.reruns++
		h.lost[k] = true
	}
	if h.runs[k] > 0 {
		switch {
		case info.Attempt == 1:
			h.remade++
		case info.Abandoned:
			h.aband++
		}
	}
	h.runs[k]++
	// A claim that ran before restarted was set may have reached either
	// server: only the later ones are compared.
	if b, ok := h.before[k]; ok && h.phase == restarted {
		h.compared++
		if info.Token <= b {
			h.regressions++
		}
	}
	if h.phase == restarted && d == idempotency.Release {
		h.tokensAfter[k] = true
	}
	h.tokens[k] = max(h.tokens[k], info.Token)
}

func (h *history) end(k idempotency.Key) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.running[k]--
}

func (h *history) answer(k idempotency.Key, resp idempotency.Response) {
	h.mu.Lock()
	defer h.mu.Unlock()
	s := render(resp)
	first, ok := h.answers[k]
	if !ok {
		h.answers[k] = answer{resp: s, phase: h.phase}
	} else if first.resp != s {
		h.lost[k] = true
	}
}

func (h *history) answered() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.answers)
}

func (h *history) tokenKeysAfter() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.tokensAfter)
}

// kill marks the moment before the kill: the tokens seen so far are the
// ones later claims must exceed.
func (h *history) kill() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.phase = down
	for k, tok := range h.tokens {
		h.before[k] = tok
	}
}

// restarted marks the server back, and returns how many keys were
// answered by then.
func (h *history) restarted() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.phase = restarted
	return len(h.answers)
}

// allKeys returns the keys whose operations settle with Keep.
func (h *history) allKeys() []idempotency.Key {
	h.mu.Lock()
	defer h.mu.Unlock()
	var keys []idempotency.Key
	for k, keep := range h.keys {
		if keep {
			keys = append(keys, k)
		}
	}
	return keys
}

func (h *history) counts() counts {
	h.mu.Lock()
	defer h.mu.Unlock()
	o := counts{
		Operations: int(h.ops.Load()), Refused: int(h.refused.Load()),
		Answered: len(h.answers), Lost: len(h.lost),
		RerunsAfterAnswer: h.reruns, Overlaps: h.overlaps, Remade: h.remade, Abandoned: h.aband,
		TokensCompared: h.compared, TokenRegressions: h.regressions,
	}
	o.Duplicates = h.calls - len(h.keys)
	for k, a := range h.answers {
		if a.phase == up {
			o.AnsweredBeforeKill++
			if h.lost[k] {
				o.LostBeforeKill++
			}
		}
	}
	return o
}

// held is an operation in flight across the restart, and a duplicate
// waiting for it.
type held struct {
	k        idempotency.Key
	waitG    *idempotency.Guard
	release  chan struct{}
	owner    chan result
	waiter   chan result
	watching chan struct{}
	ran      atomic.Bool // a waiter's operation ran
}

type result struct {
	res idempotency.Result
	err error
}

// hold starts an operation that runs until check releases it, and a
// duplicate of it through another Guard, and returns once the duplicate
// waits. The owner's lease outlasts the restart; the waiter would re-read
// the record only after its wait timed out, unless woken.
func hold(ctx context.Context, t *testing.T, s idempotency.Store, h *history) *held {
	hd := &held{k: idempotency.Key{Scope: "restart", Name: "held"},
		release: make(chan struct{}), owner: make(chan result, 1), waiter: make(chan result, 1), watching: make(chan struct{}, 16)}
	owner := idempotency.New(s, idempotency.Options{Lease: heldLease})
	hd.waitG = idempotency.New(watchedStore{Store: s, watching: hd.watching},
		idempotency.Options{WaitTimeout: waiterTimeout, RecheckInterval: time.Hour})
	started := make(chan struct{})
	go func() {
		res, err := owner.Do(ctx, hd.k, fingerprint, func(octx context.Context) (idempotency.Response, error) {
			info, _ := idempotency.FromContext(octx)
			close(started)
			// ctx too: the operation's context outlives the caller's, and a
			// failed test must not leave it running.
			select {
			case <-hd.release:
				return response(hd.k, info), nil
			case <-octx.Done():
				return idempotency.Response{}, context.Cause(octx)
			case <-ctx.Done():
				return idempotency.Response{}, ctx.Err()
			}
		})
		hd.owner <- result{res, err}
	}()
	receive(t, started, "the held operation to start")
	go func() { hd.waiter <- hd.wait(ctx) }()
	receive(t, hd.watching, "the duplicate to wait")
	h.ops.Add(2)
	h.mu.Lock()
	h.calls += 2
	h.keys[hd.k] = false
	h.mu.Unlock()
	return hd
}

func (hd *held) wait(ctx context.Context) result {
	res, err := hd.waitG.Do(ctx, hd.k, fingerprint, func(context.Context) (idempotency.Response, error) {
		hd.ran.Store(true)
		return idempotency.Response{Status: http.StatusConflict}, nil
	})
	return result{res, err}
}

// check expects the waiter to be woken after the restart (nothing else
// makes it claim again before its wait times out), lets the held operation
// finish, and expects the waiter to replay its response. A waiter whose
// claim after the wake-up still found the store unreachable may fail
// closed instead, with ErrUnavailable; its client's retry must then
// replay. check says which happened, and counts a waiter that got no
// answer as stranded.
func (hd *held) check(t *testing.T) (stranded int, how string) {
	t.Helper()
	var w result
	woken := false
	select {
	case <-hd.watching:
		woken = true
	case w = <-hd.waiter:
	case <-time.After(waiterTimeout):
		t.Errorf("the waiter was not woken after the restart")
	}
	close(hd.release)
	o := <-hd.owner
	if o.err != nil {
		t.Errorf("the operation held across the restart: %v", o.err)
		return 0, "the held operation failed"
	}
	how = "woken and replayed"
	if woken {
		w = <-hd.waiter
	} else if w.err != nil {
		if !errors.Is(w.err, idempotency.ErrUnavailable) {
			t.Errorf("the waiter across the restart: %v; want a replay, or ErrUnavailable", w.err)
			return 1, "stranded"
		}
		how = "woken, then refused (" + strings.ReplaceAll(w.err.Error(), "\n", ": ") + "), and its retry replayed"
		w = hd.wait(context.Background())
	}
	if w.err != nil || !w.res.Replayed || render(w.res.Response) != render(o.res.Response) || hd.ran.Load() {
		t.Errorf("the waiter across the restart got %+v, %v (its operation ran: %v); want the replay of %+v", w.res, w.err, hd.ran.Load(), o.res.Response)
		return 1, "stranded"
	}
	return 0, how
}

// watchedStore tells watching when a watching claim found the record in
// flight: its waiter has subscribed and registered.
type watchedStore struct {
	idempotency.Store
	watching chan<- struct{}
}

func (s watchedStore) Claim(ctx context.Context, req idempotency.ClaimRequest) (idempotency.Claim, error) {
	c, err := s.Store.Claim(ctx, req)
	if err == nil && req.Watch && c.State == idempotency.InFlight {
		select {
		case s.watching <- struct{}{}:
		default:
		}
	}
	return c, err
}

func receive(t *testing.T, c <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-c:
	case <-time.After(hang):
		t.Fatalf("waited %v for %s", hang, what)
	}
}

// waitFor polls cond until it holds, failing the test after hang.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(hang)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited %v for %s", hang, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
