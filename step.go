package idempotency

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
)

// Limits of an operation's recovery points, which its owner holds in memory
// and its record keeps until it is completed or forgotten.
const (
	// MaxSteps is the most steps one operation records.
	MaxSteps = 32
	// MaxStepName is the longest step name, in bytes of visible ASCII.
	MaxStepName = 64
	// MaxStepResult is the largest encoded result a step records, in bytes.
	MaxStepResult = 4 << 10
)

var (
	// ErrInvalidStep: a step could not be recorded. Its name is not 1 to
	// MaxStepName bytes of visible ASCII, the operation recorded MaxSteps
	// steps already, or its encoded result is larger than MaxStepResult.
	ErrInvalidStep = errors.New("idempotency: invalid step")
	// ErrNoRecoveryPoints: the Guard's store keeps no recovery points (it
	// does not implement RecoveryPointStore).
	ErrNoRecoveryPoints = errors.New("idempotency: the store keeps no recovery points")
)

// RecoveryPoint is a step of an operation that finished, with its encoded
// result, as Step recorded it.
type RecoveryPoint struct {
	Step   string
	Result []byte
}

// Step runs fn as the step name of the operation in ctx, once per
// operation: the first attempt to reach the step runs fn and records its
// result, encoded in JSON, under the attempt's fencing token before Step
// returns; every later attempt (after a crash, a lost lease or a release)
// gets that result back without running fn. So an operation made of steps
// resumes after the last step that finished instead of starting over.
//
// An error from fn records nothing and is returned: a later attempt runs
// the step again. So does a failure to record the result (the lease was
// lost, the store did not answer, the result is too large): fn did run, and
// Step returns its result with the error, which the operation should
// return. The window between fn's effect and its record stays: a step
// whose effect must not repeat should still send DownstreamKey(ctx, name)
// to the service it calls.
//
// In the one-commit mode (see Transactor) a step is a plain call: fn runs
// and nothing is recorded, since the store's transaction commits or rolls
// back the step's database effects with everything else.
//
// Steps of one operation need distinct names; two with the same name must
// not run at once. It fails with ErrNoOperation outside an operation (Do,
// the middleware, Options.Recover), with ErrNoRecoveryPoints when the
// Guard's store keeps none, and with ErrInvalidStep past the limits above.
// A completed or forgotten record drops its recovery points.
func Step[T any](ctx context.Context, name string, fn func(ctx context.Context) (T, error)) (T, error) {
	return StepCodec(ctx, JSON{}, name, fn)
}

// StepCodec is Step with the result encoded by c.
func StepCodec[T any](ctx context.Context, c Codec, name string, fn func(ctx context.Context) (T, error)) (v T, err error) {
	o, err := stepOwner(ctx, name)
	if err != nil {
		return v, err
	}
	if o == nil {
		// The one-commit mode: the step's database effects commit or roll
		// back with the whole operation, so there is nothing to record.
		return fn(ctx)
	}
	p, done, err := o.pts.find(ctx, o, name)
	switch {
	case err != nil:
		return v, err
	case done:
		if err := c.Unmarshal(p.Result, &v); err != nil {
			return v, fmt.Errorf("%w: step %q: %w", ErrUndecodable, name, err)
		}
		return v, nil
	}
	run := &stepRun{name: name, codec: c}
	if v, err = fn(context.WithValue(ctx, stepKey{}, run)); err != nil {
		return v, err
	}
	if run.saved != nil {
		o.pts.add(*run.saved)
		return v, nil
	}
	b, err := c.Marshal(v)
	if err != nil {
		return v, fmt.Errorf("idempotency: encoding the result of step %q: %w", name, err)
	}
	return v, o.pts.save(ctx, o, RecoveryPoint{Step: name, Result: b})
}

// RecoveryPoints returns the steps the operation recorded so far, in the
// order they were recorded, the earlier attempts' first: what a Recover hook
// reads to learn which step to ask a downstream service about. It fails as
// Step does.
func (i *Info) RecoveryPoints(ctx context.Context) ([]RecoveryPoint, error) {
	if i.oneCommit() || i.owner.g.points == nil {
		return nil, ErrNoRecoveryPoints
	}
	return i.owner.pts.all(ctx, i.owner)
}

// SaveStepOutside is for a store that records a step inside the caller's
// own transaction, as the postgres package's Store.StepTx does; an
// application calls that method, not this function. Called in the function
// of a Step (StepCodec), it encodes result with the step's codec and has
// save record it as that step's result, under the attempt's fencing token;
// the step then records nothing more when its function returns without an
// error. It fails without calling save outside a step's function
// (ErrInvalidStep), when the operation's Guard keeps its records in a store
// other than s (ErrForeignStore), and when the lease has ended (ErrFenced).
func SaveStepOutside(ctx context.Context, s Store, result any, save func(k Key, token uint64, p RecoveryPoint) error) error {
	run, ok := ctx.Value(stepKey{}).(*stepRun)
	i, _ := FromContext(ctx)
	switch {
	case !ok || i == nil:
		return fmt.Errorf("%w: not called in a step's function", ErrInvalidStep)
	case i.oneCommit():
		return fmt.Errorf("%w: a step's outside save", errOneCommit)
	case s != i.owner.g.store:
		return ErrForeignStore
	}
	b, err := run.codec.Marshal(result)
	if err != nil {
		return fmt.Errorf("idempotency: encoding the result of step %q: %w", run.name, err)
	}
	p := RecoveryPoint{Step: run.name, Result: b}
	if err := checkResult(p); err != nil {
		return err
	}
	if err := i.owner.usable(); err != nil {
		return err
	}
	if err := save(i.owner.k, i.owner.c.Token, p); err != nil {
		return err
	}
	run.saved = &p
	return nil
}

// stepKey is the context key of the step whose function runs.
type stepKey struct{}

// stepRun is a step whose function runs. saved is written by
// SaveStepOutside, on the function's goroutine, and read by StepCodec
// once the function returned.
type stepRun struct {
	name  string
	codec Codec
	saved *RecoveryPoint
}

// stepOwner returns the owner of the operation in ctx, once it has checked
// that it may record a step of that name.
func stepOwner(ctx context.Context, name string) (*owner, error) {
	i, ok := FromContext(ctx)
	if !ok {
		return nil, fmt.Errorf("%w: no step %q", ErrNoOperation, name)
	}
	if i.owner != nil && i.owner.g.points == nil {
		return nil, ErrNoRecoveryPoints
	}
	if len(name) == 0 || len(name) > MaxStepName {
		return nil, fmt.Errorf("%w: name of %d bytes, want 1..%d", ErrInvalidStep, len(name), MaxStepName)
	}
	if j := invisible(name); j >= 0 {
		return nil, fmt.Errorf("%w: name %q: byte 0x%02x is not visible ASCII", ErrInvalidStep, name, name[j])
	}
	return i.owner, nil
}

func checkResult(p RecoveryPoint) error {
	if len(p.Result) > MaxStepResult {
		return fmt.Errorf("%w: step %q ran, but its result of %d bytes is over %d", ErrInvalidStep, p.Step, len(p.Result), MaxStepResult)
	}
	return nil
}

// points are an owner's recovery points: those of the attempts before it,
// read from the store when first needed, then its own.
type points struct {
	// began is set before this attempt first runs a step's function: from
	// then on the operation may have had an effect (see owner.keepHistory).
	began atomic.Bool

	mu     sync.Mutex // held across the store calls, so the list keeps their order
	loaded bool       // list holds the earlier attempts' points
	list   []RecoveryPoint
}

// find returns the point of step, and whether there is one. With none, it
// fails when the operation may record no more steps.
func (ps *points) find(ctx context.Context, o *owner, step string) (RecoveryPoint, bool, error) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if err := ps.loadLocked(ctx, o); err != nil {
		return RecoveryPoint{}, false, err
	}
	for _, p := range ps.list {
		if p.Step == step {
			return p, true, nil
		}
	}
	if len(ps.list) >= MaxSteps {
		return RecoveryPoint{}, false, fmt.Errorf("%w: step %q: the operation recorded %d steps already", ErrInvalidStep, step, MaxSteps)
	}
	ps.began.Store(true) // the caller runs the step now
	return RecoveryPoint{}, false, nil
}

// all returns a copy of the list.
func (ps *points) all(ctx context.Context, o *owner) ([]RecoveryPoint, error) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if err := ps.loadLocked(ctx, o); err != nil {
		return nil, err
	}
	return append([]RecoveryPoint(nil), ps.list...), nil
}

// loadLocked reads the earlier attempts' points, once. A record's first
// attempt has none to read. ps.mu is held.
func (ps *points) loadLocked(ctx context.Context, o *owner) error {
	if ps.loaded {
		return nil
	}
	if o.c.Attempt > 1 {
		var list []RecoveryPoint
		err := o.write(ctx, func(ctx context.Context) (err error) {
			list, err = o.g.points.RecoveryPoints(ctx, o.k, o.c.Token)
			return err
		})
		if err != nil {
			return err
		}
		ps.list = list
	}
	ps.loaded = true
	return nil
}

// save records p in the store, then in the list.
func (ps *points) save(ctx context.Context, o *owner, p RecoveryPoint) error {
	if err := checkResult(p); err != nil {
		return err
	}
	ps.mu.Lock()
	defer ps.mu.Unlock()
	err := o.write(ctx, func(ctx context.Context) error {
		return o.g.points.SaveRecoveryPoint(ctx, o.k, o.c.Token, p)
	})
	if err != nil {
		return fmt.Errorf("idempotency: step %q ran, but was not recorded: %w", p.Step, err)
	}
	ps.list = append(ps.list, p)
	return nil
}

// add puts p, which the store recorded, in the list.
func (ps *points) add(p RecoveryPoint) {
	ps.mu.Lock()
	ps.list = append(ps.list, p)
	ps.mu.Unlock()
}
