package seal

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"hash"
	"sync"

	"github.com/idempotency-go/idempotency"
)

// Key is one sealing key: 32 secret bytes and the ID that names them in
// every value sealed under them. An ID names one secret for as long as any
// record sealed under it may be kept: never reuse an ID for a new secret.
type Key struct {
	// ID is 1 or more; 0 is refused, so that a Key whose ID was never set
	// cannot be configured.
	ID uint32
	// Secret is 32 bytes from a cryptographic random source (crypto/rand,
	// a secret manager), never all zero.
	Secret [32]byte
}

// Keys is a Store's key configuration. Current seals every value written
// and keys every fingerprint of a claim; Earlier keys only open values and
// match fingerprints written under them before a rotation.
type Keys struct {
	Current Key
	Earlier []Key
}

// ErrBadKeys: New was given a key configuration it refuses (an ID of 0, an
// ID used twice, a secret of zeros). Nothing was made.
var ErrBadKeys = errors.New("seal: bad key configuration")

// key is a Key made ready for use. Invariant: aead is AES-256-GCM under a
// key derived from the secret for sealing alone, and macs hold HMACs under
// a key derived from it for fingerprints alone, so that no output of one use helps an
// attack on the other.
type key struct {
	id   uint32
	aead cipher.AEAD
	macs *sync.Pool // of HMAC-SHA-256 under the fingerprint key, each used by one call at a time
}

// Labels of the keys derived from a secret: HMAC-SHA-256(secret, label), a
// pseudorandom function of a uniformly random secret, gives independent
// keys for independent labels.
const (
	sealLabel        = "idempotency-go/seal/v1 aes-256-gcm"
	fingerprintLabel = "idempotency-go/seal/v1 fingerprint"
)

func derive(secret []byte, label string) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(label))
	return m.Sum(nil)
}

func newKey(k Key) (*key, error) {
	var zero [32]byte
	switch {
	case k.ID == 0:
		return nil, fmt.Errorf("%w: key ID 0 (IDs start at 1)", ErrBadKeys)
	case subtle.ConstantTimeCompare(k.Secret[:], zero[:]) == 1:
		return nil, fmt.Errorf("%w: key %d has a secret of zeros", ErrBadKeys, k.ID)
	}
	block, err := aes.NewCipher(derive(k.Secret[:], sealLabel))
	if err != nil {
		return nil, fmt.Errorf("%w: key %d: %w", ErrBadKeys, k.ID, err)
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return nil, fmt.Errorf("%w: key %d: %w", ErrBadKeys, k.ID, err)
	}
	fp := derive(k.Secret[:], fingerprintLabel)
	macs := &sync.Pool{New: func() any { return hmac.New(sha256.New, fp) }}
	return &key{id: k.ID, aead: aead, macs: macs}, nil
}

// keyring holds a Store's keys. Invariant: byID holds current and every
// earlier key, and no two share an ID.
type keyring struct {
	current *key
	earlier []*key // in the order configured
	byID    map[uint32]*key
}

func newKeyring(ks Keys) (keyring, error) {
	r := keyring{byID: make(map[uint32]*key, 1+len(ks.Earlier))}
	for i, k := range append([]Key{ks.Current}, ks.Earlier...) {
		if _, twice := r.byID[k.ID]; twice {
			return keyring{}, fmt.Errorf("%w: key ID %d configured twice", ErrBadKeys, k.ID)
		}
		ready, err := newKey(k)
		if err != nil {
			return keyring{}, err
		}
		r.byID[k.ID] = ready
		if i == 0 {
			r.current = ready
		} else {
			r.earlier = append(r.earlier, ready)
		}
	}
	return r, nil
}

// feistelRounds is the rounds of the fingerprint permutation: four rounds
// of a Feistel network whose round functions are pseudorandom make a
// strong pseudorandom permutation (Luby and Rackoff).
const feistelRounds = 4

// fingerprint is the fingerprint kept for a request fingerprinted fp: a
// pseudorandom permutation of fp under k, a four-round Feistel network on
// its two 16-byte halves whose round function is HMAC-SHA-256 under k's
// fingerprint key with the round's number. Without the key the result
// cannot be told from random, so it cannot be checked against candidate
// requests; unlike a bare HMAC it can be inverted by the key's holder
// (unfingerprint), which is how Inspect and ListAbandoned give back the
// fingerprint a claim was made with.
func (k *key) fingerprint(fp idempotency.Fingerprint) idempotency.Fingerprint {
	m := k.macs.Get().(hash.Hash)
	defer k.macs.Put(m)
	var l, r, next [16]byte
	copy(l[:], fp[:16])
	copy(r[:], fp[16:])
	for i := range feistelRounds {
		xorRound(m, i, &r, &l, &next)
		l, r = r, next
	}
	var out idempotency.Fingerprint
	copy(out[:16], l[:])
	copy(out[16:], r[:])
	return out
}

// unfingerprint inverts fingerprint: k.unfingerprint(k.fingerprint(fp)) ==
// fp for every fp.
func (k *key) unfingerprint(kept idempotency.Fingerprint) idempotency.Fingerprint {
	m := k.macs.Get().(hash.Hash)
	defer k.macs.Put(m)
	var l, r, prev [16]byte
	copy(l[:], kept[:16])
	copy(r[:], kept[16:])
	for i := feistelRounds - 1; i >= 0; i-- {
		xorRound(m, i, &l, &r, &prev)
		l, r = prev, l
	}
	var out idempotency.Fingerprint
	copy(out[:16], l[:])
	copy(out[16:], r[:])
	return out
}

// xorRound sets out to x XOR the first 16 bytes of HMAC(round || half)
// under m's key.
func xorRound(m hash.Hash, round int, half, x, out *[16]byte) {
	m.Reset()
	m.Write([]byte{byte(round)})
	m.Write(half[:])
	var sum [sha256.Size]byte
	f := m.Sum(sum[:0])
	for i := range out {
		out[i] = x[i] ^ f[i]
	}
}
