package idempotency

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/idempotency-go/idempotency/internal/wakeup"
)

// MigrationOptions configures NewMigratingStore. The zero value of every
// field is its documented default.
type MigrationOptions struct {
	// DualWrite also claims and settles every new record in the old store.
	// Turn it on while instances that use only the old store still serve
	// traffic (a rolling deploy): they then see the new records too, as in
	// flight and then completed, and never run an operation a second time.
	// Default false: the old store is only consulted.
	DualWrite bool
}

// migratingStore is the store NewMigratingStore returns.
type migratingStore struct {
	old, new Store
	opts     MigrationOptions

	mu   sync.Mutex
	dual map[ownerRef]uint64 // DualWrite: the old store's token of each record owned here
}

type ownerRef struct {
	k     Key
	token uint64 // the new store's token
}

// NewMigratingStore returns a store that moves a service from old to new
// without a gap: claims go to new, but a key old already holds is honoured
// as it is there (replayed, mismatched, waited for, or taken over with its
// operation ID) instead of run again, and the record moves to new. Use it
// until old's retention window has run out, then use new alone;
// docs/stores.md in the repository gives the whole procedure.
//
// A claim that is fresh in new costs a claim in old as well; one new can
// answer costs nothing more. A waiter is woken by a settlement in either
// store. ListAbandoned and ListInFlight list new's records only: sweep and
// list old with a Guard and a store of its own. Inspect shows new's record,
// or else old's.
func NewMigratingStore(old, new Store, o MigrationOptions) Store {
	return &migratingStore{old: old, new: new, opts: o, dual: make(map[ownerRef]uint64)}
}

func (m *migratingStore) Claim(ctx context.Context, req ClaimRequest) (Claim, error) {
	c, err := m.new.Claim(ctx, req)
	if err != nil || c.State != Owner {
		return c, err // the new store has the answer
	}
	// This caller now holds the key in the new store, so no other claim of
	// it gets this far: ask the old store, which may know the key from
	// before the migration. A takeover asks too, in case the record was
	// left in the new store half-way through an earlier step.
	// Whatever this claim ends with, the record it took in the new store
	// must not stay taken: undo even when ctx is done, within a lease.
	undo, cancel := context.WithTimeout(context.WithoutCancel(ctx), req.Lease)
	defer cancel()
	asOld := req
	asOld.OperationID = c.OperationID
	o, err := m.old.Claim(ctx, asOld)
	switch {
	case err != nil:
		return Claim{}, errors.Join(err, giveBack(undo, m.new, req.Key, c))
	case o.State == Completed:
		// Bring the outcome over; from now on the new store answers.
		if err := m.new.Complete(undo, req.Key, c.Token, o.Response, req.Retention); err != nil {
			return Claim{}, err
		}
		return o, nil
	case o.State != Owner:
		// In flight or mismatched in the old store: that answer stands.
		return o, giveBack(undo, m.new, req.Key, c)
	}
	return m.adopt(ctx, undo, req, c, o)
}

// adopt makes the caller, owner c of the record in the new store and o in
// the old, the one owner of the key: with the old attempt's operation ID,
// attempt count and abandonment, and the old record given back unless
// DualWrite keeps it.
func (m *migratingStore) adopt(ctx, undo context.Context, req ClaimRequest, c, o Claim) (Claim, error) {
	if o.OperationID != c.OperationID {
		// The old store's attempt was released or abandoned: carry its
		// operation ID over, so that its downstream keys stay the same.
		if err := m.new.Forget(undo, req.Key, c.Token); err != nil {
			return Claim{}, errors.Join(err, m.old.Release(undo, req.Key, o.Token))
		}
		moved := req
		moved.OperationID = o.OperationID
		var err error
		if c, err = m.new.Claim(ctx, moved); err != nil || c.State != Owner {
			return c, errors.Join(err, m.old.Release(undo, req.Key, o.Token))
		}
	}
	c.Attempt = max(c.Attempt, o.Attempt)
	c.Abandoned = c.Abandoned || o.Abandoned
	if err := m.movePoints(ctx, req.Key, c.Token, o.Token); err != nil {
		return Claim{}, errors.Join(err, giveBack(undo, m.new, req.Key, c), m.old.Release(undo, req.Key, o.Token))
	}
	if m.opts.DualWrite {
		m.remember(req.Key, c.Token, o.Token)
		return c, nil
	}
	// Leave the old store without the record, or with it released: the new
	// owner carries on whether the old attempt was abandoned.
	o.Abandoned = false
	return c, giveBack(undo, m.old, req.Key, o)
}

// movePoints copies the recovery points the old store keeps for its owner
// old into the new store, for its owner token.
func (m *migratingStore) movePoints(ctx context.Context, k Key, token, old uint64) error {
	oldPts, ok1 := m.old.(RecoveryPointStore)
	newPts, ok2 := m.new.(RecoveryPointStore)
	if !ok1 || !ok2 {
		return nil
	}
	ps, err := oldPts.RecoveryPoints(ctx, k, old)
	for _, p := range ps {
		if err == nil {
			err = newPts.SaveRecoveryPoint(ctx, k, token, p)
		}
	}
	return err
}

// SaveRecoveryPoint implements RecoveryPointStore: in the old store first,
// as Complete, when the owner holds the record there too.
func (m *migratingStore) SaveRecoveryPoint(ctx context.Context, k Key, token uint64, p RecoveryPoint) error {
	newPts, ok := m.new.(RecoveryPointStore)
	if !ok {
		return ErrNoRecoveryPoints
	}
	if old, ok := m.oldToken(k, token, false); ok {
		if oldPts, ok := m.old.(RecoveryPointStore); ok {
			if err := oldPts.SaveRecoveryPoint(ctx, k, old, p); err != nil {
				return err
			}
		}
	}
	return newPts.SaveRecoveryPoint(ctx, k, token, p)
}

// RecoveryPoints implements RecoveryPointStore: the new store's, which
// holds the old store's too once the claim moved the record over.
func (m *migratingStore) RecoveryPoints(ctx context.Context, k Key, token uint64) ([]RecoveryPoint, error) {
	newPts, ok := m.new.(RecoveryPointStore)
	if !ok {
		return nil, ErrNoRecoveryPoints
	}
	return newPts.RecoveryPoints(ctx, k, token)
}

func (m *migratingStore) remember(k Key, token, old uint64) {
	m.mu.Lock()
	m.dual[ownerRef{k, token}] = old
	m.mu.Unlock()
}

// oldToken returns the old store's token for an owner, if it holds one;
// with done, it is forgotten.
func (m *migratingStore) oldToken(k Key, token uint64, done bool) (uint64, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	t, ok := m.dual[ownerRef{k, token}]
	if done {
		delete(m.dual, ownerRef{k, token})
	}
	return t, ok
}

// Complete stores the outcome in the old store first, when the owner holds
// the record there too. Instances still on the old store read it alone, and
// a migrating claim that finds the new store's record lapsed asks the old
// one, so an outcome the old store holds is the one every instance answers.
// The other way round, an outcome only the new store took would be replayed
// by migrating instances while instances on the old store let the record
// lapse, ran the operation again and answered another outcome.
func (m *migratingStore) Complete(ctx context.Context, k Key, token uint64, resp Response, retention time.Duration) error {
	if old, ok := m.oldToken(k, token, true); ok {
		if err := m.old.Complete(ctx, k, old, resp, retention); err != nil {
			return err
		}
	}
	return m.new.Complete(ctx, k, token, resp, retention)
}

func (m *migratingStore) Release(ctx context.Context, k Key, token uint64) error {
	return m.settle(ctx, k, token, Store.Release)
}

func (m *migratingStore) Forget(ctx context.Context, k Key, token uint64) error {
	return m.settle(ctx, k, token, Store.Forget)
}

func (m *migratingStore) Abandon(ctx context.Context, k Key, token uint64) error {
	return m.settle(ctx, k, token, Store.Abandon)
}

// settle makes an owner's last call in the new store, then in the old one
// when the owner holds the record there too.
func (m *migratingStore) settle(ctx context.Context, k Key, token uint64, call func(Store, context.Context, Key, uint64) error) error {
	if err := call(m.new, ctx, k, token); err != nil {
		return err
	}
	if old, ok := m.oldToken(k, token, true); ok {
		return call(m.old, ctx, k, old)
	}
	return nil
}

func (m *migratingStore) Heartbeat(ctx context.Context, k Key, token uint64, lease time.Duration) error {
	if err := m.new.Heartbeat(ctx, k, token, lease); err != nil {
		if errors.Is(err, ErrFenced) {
			m.oldToken(k, token, true)
		}
		return err
	}
	if old, ok := m.oldToken(k, token, false); ok {
		return m.old.Heartbeat(ctx, k, old, lease)
	}
	return nil
}

func (m *migratingStore) ListAbandoned(ctx context.Context, limit int) ([]AbandonedRecord, error) {
	return m.new.ListAbandoned(ctx, limit)
}

// Inspect implements Inspector: the new store's record of k or, when it
// has none, the old store's, which the next claim moves over.
func (m *migratingStore) Inspect(ctx context.Context, k Key) (Record, error) {
	newIn, oldIn, err := m.inspectors()
	if err != nil {
		return Record{}, err
	}
	r, err := newIn.Inspect(ctx, k)
	if errors.Is(err, ErrNoRecord) {
		return oldIn.Inspect(ctx, k)
	}
	return r, err
}

// ListInFlight implements Inspector for the new store's records only, as
// ListAbandoned does: inspect the old store with a store of its own.
func (m *migratingStore) ListInFlight(ctx context.Context, after string, limit int) ([]Record, string, error) {
	newIn, _, err := m.inspectors()
	if err != nil {
		return nil, "", err
	}
	return newIn.ListInFlight(ctx, after, limit)
}

func (m *migratingStore) inspectors() (newIn, oldIn Inspector, err error) {
	newIn, ok1 := m.new.(Inspector)
	oldIn, ok2 := m.old.(Inspector)
	if !ok1 || !ok2 {
		return nil, nil, errors.New("idempotency: a store of the migration is no Inspector")
	}
	return newIn, oldIn, nil
}

func (m *migratingStore) Subscribe(ctx context.Context, k Key) (Subscription, error) {
	n, err := m.new.Subscribe(ctx, k)
	if err != nil {
		return nil, err
	}
	o, err := m.old.Subscribe(ctx, k)
	if err != nil {
		n.Close()
		return nil, err
	}
	s := &bothSub{subs: [2]Subscription{n, o}, c: wakeup.NewSignal(), done: make(chan struct{})}
	for _, sub := range s.subs {
		s.wg.Go(func() {
			for {
				select {
				case <-sub.C():
					s.c.Wake()
				case <-s.done:
					return
				}
			}
		})
	}
	return s, nil
}

// bothSub merges the wake-ups of two subscriptions.
type bothSub struct {
	subs [2]Subscription
	c    wakeup.Signal
	done chan struct{}
	wg   sync.WaitGroup
	once sync.Once
}

func (s *bothSub) C() <-chan struct{} { return s.c }

func (s *bothSub) Close() {
	s.once.Do(func() {
		close(s.done)
		s.wg.Wait()
		for _, sub := range s.subs {
			sub.Close()
		}
	})
}
