package main

// A charge, step by step, and its recovery after a crash.

import (
	"context"
	"errors"
	"fmt"
	"log"

	"github.com/idempotency-go/idempotency"
)

// charge runs a charge's three steps (place the order, charge the card,
// send the receipt), then records the charge in the ledger and returns the
// 201, reporting whether the ledger's transaction stored it already (see
// recordCharge). Each step runs once per operation (see step): an attempt
// after a crash resumes after the last step recorded.
func (a *api) charge(ctx context.Context, req chargeRequest) (idempotency.Response, bool, error) {
	// The provider's key comes from the operation, not from the client's
	// key: every attempt at this operation, on any instance, sends the
	// same one, so a call made again after a crash, before its step was
	// recorded, gets the original charge back instead of charging twice.
	// It fails outside an operation, where no step can run either.
	key, err := idempotency.DownstreamKey(ctx, "gateway")
	if err != nil {
		return idempotency.Response{}, false, err
	}
	o, err := step(ctx, a, "order", func(ctx context.Context) (order, error) { return a.placeOrder(ctx, req) })
	if err != nil {
		return idempotency.Response{}, false, serviceError{"orders", err}
	}
	c, err := step(ctx, a, "charge", func(ctx context.Context) (charge, error) { return a.gateway.charge(ctx, key, req) })
	if err != nil {
		return idempotency.Response{}, false, serviceError{"gateway", err}
	}
	return a.finish(ctx, c, func(ctx context.Context) (receipt, error) { return a.sendReceipt(ctx, o, c) })
}

// finish runs the receipt step with send, then records c in the ledger and
// returns its 201, as charge does.
func (a *api) finish(ctx context.Context, c charge, send func(context.Context) (receipt, error)) (idempotency.Response, bool, error) {
	if _, err := step(ctx, a, "receipt", send); err != nil {
		return idempotency.Response{}, false, serviceError{"receipts", err}
	}
	resp, err := chargeCreated(c)
	if err != nil {
		return resp, false, err
	}
	completed, err := a.recordCharge(ctx, c, resp)
	if err != nil {
		return resp, false, serviceError{"ledger", err}
	}
	return resp, completed, nil
}

// placeOrder places the operation's order. On PostgreSQL the order and its
// recovery point commit in one transaction: no crash leaves an order
// placed whose step is not recorded.
func (a *api) placeOrder(ctx context.Context, req chargeRequest) (order, error) {
	info, _ := idempotency.FromContext(ctx) // always there: step runs it in an operation
	o := order{ID: newID("ord_"), Operation: info.OperationID, Attempt: info.Attempt,
		Amount: req.Amount, Currency: req.Currency, Source: req.Source}
	if to, ok := a.orders.(transactionalOrders); ok && a.resume {
		return o, to.placeRecorded(ctx, o)
	}
	return o, a.orders.place(ctx, o)
}

// sendReceipt sends the receipt of charge c for order o.
func (a *api) sendReceipt(ctx context.Context, o order, c charge) (receipt, error) {
	info, _ := idempotency.FromContext(ctx)
	r := receipt{ID: newID("rc_"), Operation: info.OperationID, Attempt: info.Attempt, Order: o.ID, Charge: c.ID,
		Amount: c.Amount, Currency: c.Currency}
	return r, a.receipts.send(ctx, r)
}

// step runs fn as the step name of the operation in ctx. With recovery
// points (a.resume) it runs through idempotency.Step: the first attempt to
// reach it runs fn and records its result, and a later attempt gets that
// result back without running fn. Without, every attempt runs fn. An
// instance started with -crash-after may then kill itself (see crasher).
func step[T any](ctx context.Context, a *api, name string, fn func(context.Context) (T, error)) (T, error) {
	if !a.resume {
		v, err := fn(ctx)
		if err == nil {
			a.crash.after(ctx, name)
		}
		return v, err
	}
	ran := false
	v, err := idempotency.Step(ctx, name, func(ctx context.Context) (T, error) {
		ran = true
		return fn(ctx)
	})
	if err == nil && ran {
		a.crash.after(ctx, name)
	}
	return v, err
}

// recordCharge writes c to the ledger under the attempt's fencing token,
// which lets the ledger refuse an attempt that was taken over (it stalled
// past its lease) and wakes up late. A ledger in the idempotency store's
// database also completes the operation with answer in the same
// transaction, and recordCharge reports true: the middleware then sends
// answer, exactly what was committed, and the handler writes nothing.
func (a *api) recordCharge(ctx context.Context, c charge, answer idempotency.Response) (completed bool, err error) {
	info, _ := idempotency.FromContext(ctx) // always there: the Guard runs the handler and the hook
	if tl, ok := a.ledger.(transactionalLedger); ok {
		return true, tl.recordCompleting(ctx, c, info.Token, answer)
	}
	return false, a.ledger.record(ctx, c, info.Token)
}

// errNotDone is a step that its service says never happened.
var errNotDone = errors.New("the step never happened")

// recoverCharge is the Guard's Options.Recover. It runs, as the record's new
// owner, when an attempt at a charge was abandoned: its instance died or
// stalled past its lease somewhere between claiming the key and storing its
// answer. The steps that attempt recorded tell how far it got, but for the
// step it was in, which may or may not have happened: the hook asks that
// step's service, under the operation, and records what the service says
// happened as the step's result, so that it never runs again.
//   - The card was charged: the hook finishes the charge as the handler
//     would have (the receipt, unless one was sent, and the ledger) and
//     stores the very 201 the handler would have sent.
//   - It was not: the key is released, and the handler runs now, resuming
//     after the steps recorded.
//   - A service cannot say: the record stays abandoned for a later retry
//     or sweep, and the client is told to retry (409).
func (a *api) recoverCharge(ctx context.Context) (idempotency.Response, error) {
	info, _ := idempotency.FromContext(ctx)
	op := info.OperationID
	key, err := idempotency.DownstreamKey(ctx, "gateway")
	if err != nil {
		return idempotency.Response{}, err
	}
	o, err := idempotency.Step(ctx, "order", func(ctx context.Context) (order, error) {
		return happened(a.orders.placedBy(ctx, op))
	})
	var c charge
	if err == nil {
		c, err = idempotency.Step(ctx, "charge", func(ctx context.Context) (charge, error) {
			return happened(a.gateway.lookup(ctx, key))
		})
	}
	switch {
	case errors.Is(err, errNotDone):
		log.Printf("recover: %s never charged; released for the handler to run", key)
		idempotency.SetDisposition(ctx, idempotency.Release)
		return idempotency.Response{}, nil
	case err != nil:
		// Logged here, since a sweep does not report a record it could not
		// settle yet.
		log.Printf("recover: %s: %v; left abandoned", key, err)
		return idempotency.Response{}, fmt.Errorf("%w: %w", idempotency.ErrUnknown, err)
	}
	resp, _, err := a.finish(ctx, c, func(ctx context.Context) (receipt, error) {
		if r, sent, err := a.receipts.sentFor(ctx, op); err != nil || sent {
			return r, err
		}
		return a.sendReceipt(ctx, o, c)
	})
	if err != nil {
		return idempotency.Response{}, err
	}
	log.Printf("recover: %s had charged %s; recorded it", key, c.ID)
	return resp, nil
}

// happened is a lookup's answer as a step's result: what the service found,
// or errNotDone when it found nothing.
func happened[T any](v T, found bool, err error) (T, error) {
	if err == nil && !found {
		err = errNotDone
	}
	return v, err
}

// serviceError is a service that failed a charge at one of its steps.
type serviceError struct {
	service string // orders, gateway, receipts or ledger
	err     error
}

func (e serviceError) Error() string { return e.service + ": " + e.err.Error() }
func (e serviceError) Unwrap() error { return e.err }
