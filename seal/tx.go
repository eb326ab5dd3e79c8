package seal

import (
	"context"
	"fmt"
	"time"

	"github.com/idempotency-go/idempotency"
)

// TxStore is a Store over a store that runs each operation in one
// transaction of its own, an idempotency.Transactor such as the postgres
// package's one-commit mode: a Guard made with it keeps that mode, the
// operation's writes and its record committing together, and the record
// is sealed as a Store seals it.
type TxStore struct {
	*Store
	tx idempotency.Transactor // the inner store
}

var _ idempotency.Transactor = (*TxStore)(nil)

// NewTx returns a TxStore that seals the records inner keeps under keys,
// or an error wrapping ErrBadKeys. inner must be an idempotency.Transactor.
func NewTx(inner idempotency.Store, keys Keys) (*TxStore, error) {
	tx, ok := inner.(idempotency.Transactor)
	if !ok {
		return nil, fmt.Errorf("seal: NewTx needs a store that runs operations in one transaction (an idempotency.Transactor), got %T", inner)
	}
	s, err := newStore(inner, keys)
	if err != nil {
		return nil, err
	}
	return &TxStore{Store: s, tx: tx}, nil
}

// Transact implements idempotency.Transactor. It claims as Store.Claim
// does, with the request's fingerprint keyed, a retry across a rotation
// answered from its record, and a stored response opened, and it seals the
// response op keeps before the inner store stores it. op sees the caller's
// operation ID.
func (s *TxStore) Transact(ctx context.Context, req idempotency.ClaimRequest, wait time.Duration,
	op func(ctx context.Context, c idempotency.Claim) (idempotency.Response, bool, error)) (idempotency.Claim, error) {
	sealed := func(ctx context.Context, c idempotency.Claim) (idempotency.Response, bool, error) {
		c.OperationID, _, _ = untagOperation(c.OperationID)
		resp, keep, err := op(ctx, c)
		if err == nil && keep {
			resp = s.sealResponse(req.Key, resp)
		}
		return resp, keep, err
	}
	return s.claim(ctx, req, func(ctx context.Context, req idempotency.ClaimRequest) (idempotency.Claim, error) {
		return s.tx.Transact(ctx, req, wait, sealed)
	})
}
