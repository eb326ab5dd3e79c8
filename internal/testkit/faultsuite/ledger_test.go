package faultsuite

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idempotency-go/idempotency"
)

// call is one call of Guard.Do, as its caller saw it.
type call struct {
	key      string
	instance int  // the Guard's; -1 for the checks after the faults
	dup      bool // an earlier call had the same key
	// start and end bound the call, end is zero until it returned.
	start, end time.Time
	res        idempotency.Result
	err        error
	// Set by the Guard's Observer, on the call's goroutine (waited) and
	// on the owner's timer (renewals).
	waited                  time.Duration
	renewals, renewalFailed atomic.Int32
}

// execution is one run of an operation: the side effect that must happen
// at most once per key.
type execution struct {
	id      int
	key     string
	attempt int
	ctx     context.Context
	call    *call
	start   time.Time
	running bool
	// finished says the work ran to its end and the operation returned
	// body, the response that names this execution.
	finished bool
	body     string
	// overlapped says it began while another execution of its key was
	// running with a live context: two owners at once.
	overlapped bool
}

// stepRun is one run of a step's function, in an execution of an operation
// made of steps. Once Step confirmed its recording, by returning nil after
// running it, no later attempt may run the step again.
type stepRun struct {
	id   int
	exec *execution
	step string
	// start is when the function began; finished says it ran to its end
	// and returned id, its result.
	start    time.Time
	finished bool
	// confirmed is when Step returned nil after running it; zero when
	// Step failed.
	confirmed time.Time
}

// stepAnswer is a result Step returned nil with, whether it ran the
// step's function or replayed the result recorded: the id of a run.
type stepAnswer struct {
	exec   *execution
	step   string
	result int
}

// ledger records every call and every execution of one run, and every run
// of a step's function: runs are never merged, however often a step runs.
type ledger struct {
	mu      sync.Mutex
	execs   []*execution
	byKey   map[string][]*execution
	calls   []*call
	keys    []string // in the order of their first call
	runs    []*stepRun
	answers []stepAnswer
}

func newLedger() *ledger {
	return &ledger{byKey: make(map[string][]*execution)}
}

// called records c as started.
func (l *ledger) called(c *call) {
	l.mu.Lock()
	defer l.mu.Unlock()
	c.start = time.Now()
	l.calls = append(l.calls, c)
}

// returned records what Do answered c.
func (l *ledger) returned(c *call, res idempotency.Result, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	c.end, c.res, c.err = time.Now(), res, err
}

// begin records an execution of c's key starting now, as attempt, with
// the operation's context ctx. It is where two owners at once are caught:
// another execution still running whose context is not done.
func (l *ledger) begin(c *call, attempt int, ctx context.Context) *execution {
	l.mu.Lock()
	defer l.mu.Unlock()
	e := &execution{id: len(l.execs), key: c.key, attempt: attempt, ctx: ctx, call: c, start: time.Now(), running: true}
	for _, o := range l.byKey[c.key] {
		if o.running && o.ctx.Err() == nil {
			e.overlapped = true
		}
	}
	l.execs = append(l.execs, e)
	l.byKey[c.key] = append(l.byKey[c.key], e)
	return e
}

// end records e's end: with the response body it returns, or, when body
// is empty, cut short by its context.
func (l *ledger) end(e *execution, body string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	e.running = false
	e.finished, e.body = body != "", body
}

// stepBegin records a run of step's function starting now, in e.
func (l *ledger) stepBegin(e *execution, step string) *stepRun {
	l.mu.Lock()
	defer l.mu.Unlock()
	sr := &stepRun{id: len(l.runs), exec: e, step: step, start: time.Now()}
	l.runs = append(l.runs, sr)
	return sr
}

// stepEnd records that sr's function ran to its end.
func (l *ledger) stepEnd(sr *stepRun) {
	l.mu.Lock()
	defer l.mu.Unlock()
	sr.finished = true
}

// stepAnswered records that Step returned nil, with result, for step in e;
// ran is the run it made, nil when it replayed the recorded result.
func (l *ledger) stepAnswered(e *execution, step string, result int, ran *stepRun) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if ran != nil {
		ran.confirmed = time.Now()
	}
	l.answers = append(l.answers, stepAnswer{exec: e, step: step, result: result})
}

// bodyOf is the response body of execution id of key: it names both, so
// that a replay tells which execution it stores, then the runs whose
// results its steps answered (refs, as steps writes them), padded to size
// bytes.
func bodyOf(key string, id int, refs string, size int) string {
	s := key + "#" + strconv.Itoa(id) + "|" + refs + "|"
	return s + strings.Repeat("x", max(0, size-len(s)))
}

// answered is the execution a success answered, or an error saying why the
// answer is not a response an execution of c's key returned. l.mu must be
// held.
func (l *ledger) answered(c *call) (*execution, error) {
	body := string(c.res.Response.Body)
	head, _, _ := strings.Cut(body, "|")
	key, id, ok := strings.Cut(head, "#")
	n, err := strconv.Atoi(id)
	switch {
	case !ok || err != nil || n < 0 || n >= len(l.execs):
		return nil, fmt.Errorf("the body %.40q names no execution", body)
	case key != c.key:
		return nil, fmt.Errorf("the body %.40q is another key's", body)
	case !l.execs[n].finished || l.execs[n].body != body:
		return nil, fmt.Errorf("the body %.40q is not what execution %d returned", body, n)
	}
	return l.execs[n], nil
}

// failure names the error a call failed with when it is one a call may
// fail with under network faults, and is "" for any other.
func failure(err error) string {
	switch {
	case errors.Is(err, idempotency.ErrFenced):
		return "fenced"
	case errors.Is(err, idempotency.ErrInFlight):
		return "in_flight"
	case errors.Is(err, idempotency.ErrUnavailable):
		return "unavailable"
	}
	return ""
}

// callKey carries a call in its contexts, for the Observer.
type callKey struct{}

// observer tells each call what the Guard observed of it.
type observer struct{}

func (observer) Observe(ctx context.Context, e idempotency.Event) {
	c, ok := ctx.Value(callKey{}).(*call)
	if !ok {
		return
	}
	switch e.Kind {
	case idempotency.EventOutcome:
		c.waited = e.Waited
	case idempotency.EventRenewal:
		c.renewals.Add(1)
		if e.Err != nil {
			c.renewalFailed.Add(1)
		}
	}
}
