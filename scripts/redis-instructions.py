#!/usr/bin/env python3
"""Counts the instructions Redis spends on the lock cycle: the broker's CLAIM and RELEASE scripts
for an uncontended exclusive lock, beside the minimal proxy's `SET NX PX` and compare-and-delete.

Starts its own `redis-server` under valgrind's callgrind on a free loopback port, loads the
scripts as the broker joins them (the file lists of `lua!` in redis-store/src/scripts/mod.rs),
sends each step as one pipelined batch of `--calls` commands on new keys (the arguments a plain
lock's call writes, see scripts/grant.rs and holder.rs), and reads callgrind's instruction count
between the steps. Instruction counts do not move with the machine's load, unlike timings, so
two versions of the scripts compare in one run: `--against REV` measures the scripts of a git
revision too. Needs valgrind (`apt-get install -y valgrind`) and redis-server.

    scripts/redis-instructions.py [--calls 2000] [--against REV] [--functions] [--contended]

`--functions` calls the work tree's scripts as the broker runs them on one Redis and Sentinel:
as functions of its library (`FCALL`; the library printed by `lockbroker-bench redis-library`),
where `--against`'s revision still runs by SHA.

`--batch N` counts the BATCH script instead (group commit): calls of N claims each on new keys,
then calls of N releases of them, per operation.

`--contended` counts the hot key's scripts per handoff instead: RELEASE that hands the key to
the queue's head (the context's kind `g`: granted outright when the head is a bid of the
releasing broker; offered when it is another broker's, which then takes it with its CLAIM), then
CLAIM of a new bid that queues behind it; each on its own key, after a holder and four queued
bids were set up there (not counted).
"""
import argparse, glob, os, random, re, shutil, socket, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where the scripts are; a revision from before the Redis store had its own crate has them at
# the second path.
SCRIPTS = ('redis-store/src/scripts', 'src/store/redis/scripts')


def source(rev, path):
    if rev is None:
        with open(os.path.join(ROOT, path)) as f:
            return f.read()
    return subprocess.run(['git', '-C', ROOT, 'show', f'{rev}:{path}'], capture_output=True,
                          text=True, check=True).stdout


def scripts_dir(rev):
    for d in SCRIPTS:
        try:
            source(rev, f'{d}/mod.rs')
            return d
        except (OSError, subprocess.CalledProcessError):
            pass
    sys.exit(f'no scripts at {" or ".join(SCRIPTS)} in {rev or "the work tree"}')


def script(rev, name):
    """The script `name` as the broker sends it: its files joined, comment lines dropped."""
    where = scripts_dir(rev)
    files = re.search(name + r': lua!\("' + name + r'": ([^)]*)\)', source(rev, f'{where}/mod.rs'))
    text = ''.join(source(rev, f'{where}/{f}') for f in re.findall(r'"([^"]+)"', files.group(1)))
    return ''.join(l + '\n' for l in text.splitlines() if not l.lstrip().startswith('--'))


def resp(commands):
    out = bytearray()
    for args in commands:
        out += b'*%d\r\n' % len(args)
        for a in args:
            b = str(a).encode()
            out += b'$%d\r\n%s\r\n' % (len(b), b)
    return bytes(out)


def revisions(opts):
    """The scripts to count: `--against`'s revision first, if given, then the work tree (None)."""
    return ([opts.against] if opts.against else []) + [None]


# The function library loaded (`--functions`): its name, which its functions' names begin with.
LIBRARY = []


def load(cli, rev, name):
    """Loads the script `name` of `rev` into Redis: the command that calls it, up to its keys —
    `EVALSHA` and its SHA, or, for the work tree with `--functions`, `FCALL` and its function."""
    if rev is None and LIBRARY:
        return ['FCALL', f'{LIBRARY[0]}_{name}']
    return ['EVALSHA', cli('script', 'load', script(rev, name)).stdout.decode().strip()]


def load_library(cli):
    """Loads the work tree's function library (`lockbroker-bench redis-library` prints it)."""
    text = subprocess.run(['cargo', 'run', '-q', '-p', 'lockbroker-bench', '--',
                           'redis-library'], cwd=ROOT, capture_output=True, check=True).stdout
    LIBRARY.append(cli('function', 'load', data=None, arg=text).stdout.decode().strip())


def key_names(k):
    """The KEYS of a script on the queue's key `k` (lib/keys.lua's order), the marker `lb:epoch`."""
    return [f'{k}:lock', f'{k}:fence', 'lb:epoch', f'{k}:shared', f'{k}:shared:ends', f'{k}:queue',
            f'{k}:bids', f'{k}:watched']


def batched(opts, cli, count):
    """BATCH (group commit): claims, then releases, `opts.batch` operations per call."""
    per, n = opts.batch, opts.calls
    print(f'Redis instructions per operation (callgrind, {n} BATCH calls of {per} operations per step, new keys)')
    print(f'{"scripts":<22}{"claim":>10}{"release":>10}{"cycle":>10}{"keys left":>11}')
    for rev in revisions(opts):
        batch = load(cli, rev, 'batch')
        tag = random.randrange(10 ** 9)

        def call(op, j):
            keys, args = ['lb:epoch'], ['E1', 'broker1']
            for i in range(j * per, (j + 1) * per):
                k = f'lb:{{b{tag}-{i}}}'
                keys += [f'{k}:lock', f'{k}:fence', f'{k}:shared:ends', f'{k}:queue', f'{k}:watched']
                args += [op, f'tok{i}', 30000] if op == 'c' else [op, f'tok{i}']
            return [*batch, len(keys), *keys, *args]
        before = int(cli('dbsize').stdout)
        c = count('claim', [call('c', j) for j in range(n)]) / per
        # Granted in the batch, not answered SLOW (which writes nothing).
        if cli('exists', f'lb:{{b{tag}-0}}:lock').stdout.strip() != b'1':
            sys.exit(f'{rev or "working tree"}: the batch granted nothing')
        r = count('release', [call('r', j) for j in range(n)]) / per
        left = int(cli('dbsize').stdout) - before
        print(f'{rev or "working tree":<22}{c:>10.0f}{r:>10.0f}{c + r:>10.0f}{left / (n * per):>11.3f}')


def contended(opts, cli, count):
    """The hot key's scripts per handoff: RELEASE handing the key to the next bid (granted outright
    to a bid of the releasing broker; offered to another broker's, which takes it with its CLAIM),
    then CLAIM of a new bid that queues."""
    n = opts.calls
    print(f'Redis instructions per call (callgrind, {n} calls per step, a key each: a holder and 4 queued bids)')
    print(f'{"scripts":<14}{"next bid":<16}{"release":>10}{"take":>10}{"claim":>10}{"handoff":>10}')
    for rev in revisions(opts):
        if 'context_of' not in script(rev, 'claim') or "'g'" not in script(rev, 'release'):
            sys.exit(f'{rev}: its scripts have no direct grant (RELEASE with kind g) to count')
        claim, release = load(cli, rev, 'claim'), load(cli, rev, 'release')
        for whose, queued_by in (('own broker', 'broker1'), ('another broker', 'broker2')):
            tag = random.randrange(10 ** 9)

            def keys(i):
                return key_names(f'lb:{{h{tag}-{i}}}')

            def ctx(i, wait, kind):
                # wait|kind|window|space|#chan|#shared| then the channel prefix and the client
                # key; a long offer window, so that nothing lapses under callgrind's pace.
                return f'{wait}|{kind}|600000|L|5|0|lb:b:h{tag}-{i}'

            def bid(i, token, wait, broker='broker1'):
                return [*claim, 8, *keys(i), token, 30000, '', 'E1', '', broker,
                        ctx(i, wait, 'x')]
            setup = []
            for i in range(n):
                setup.append(bid(i, f'a{i}', 0))
                setup += [bid(i, f'q{q}-{i}', 20000, queued_by) for q in range(4)]
            out = cli('--pipe', data=resp(setup)).stdout
            if b'errors: 0' not in out:
                sys.exit(f'setup: {out.decode()}')
            r = count('release', [[*release, 8, *keys(i), f'a{i}', 'E1', 'broker1',
                                   ctx(i, 0, 'g')] for i in range(n)])
            offered = cli('hget', keys(0)[0], 'offered').stdout.strip() == b'1'
            take = 0
            if queued_by != 'broker1':
                take = count('take', [bid(i, f'q0-{i}', 20000, queued_by) for i in range(n)])
            c = count('claim', [bid(i, f'b{i}', 20000) for i in range(n)])
            # The key went to q0 (outright to the releasing broker's bid, by offer and take to
            # another's), and the new bid queued.
            holder = cli('hget', keys(0)[0], 'token').stdout.strip()
            still_offered = cli('hget', keys(0)[0], 'offered').stdout.strip() == b'1'
            queued = cli('zscore', keys(0)[5], 'b0').stdout.strip()
            if (holder != b'q0-0' or still_offered or not queued
                    or offered != (queued_by != 'broker1')):
                sys.exit(f'{rev or "working tree"}, {whose}: not the hot path (holder {holder}, '
                         f'offered {offered}, b0 queued {queued})')
            print(f'{rev or "working tree":<14}{whose:<16}{r:>10.0f}{take:>10.0f}{c:>10.0f}'
                  f'{r + take + c:>10.0f}')


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--calls', type=int, default=2000)
    ap.add_argument('--against', metavar='REV', help='also measure the scripts of this git revision')
    ap.add_argument('--batch', type=int, metavar='N', help='BATCH calls of N operations instead')
    ap.add_argument('--functions', action='store_true',
                    help="the work tree's scripts as the broker's function library (FCALL), not by SHA")
    ap.add_argument('--contended', action='store_true',
                    help="the hot key's scripts per handoff instead (RELEASE, the offer's take, a queued CLAIM)")
    opts = ap.parse_args()
    for tool in ('valgrind', 'callgrind_control', 'callgrind_annotate', 'redis-server', 'redis-cli'):
        if not shutil.which(tool):
            sys.exit(f'{tool} not found (apt-get install -y valgrind redis-server)')
    work = tempfile.mkdtemp(prefix='lockbroker-instructions-')
    s = socket.socket(); s.bind(('127.0.0.1', 0)); port = str(s.getsockname()[1]); s.close()
    server = subprocess.Popen(
        ['valgrind', '--tool=callgrind', f'--callgrind-out-file={work}/cg.out', 'redis-server',
         '--port', port, '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no', '--dir', work],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def cli(*args, data=None, arg=None):
        # `arg`: a last argument read from stdin (`-x`), for one too long for a command line.
        x = ['-x'] if arg is not None else []
        return subprocess.run(['redis-cli', '-p', port, *x, *args], input=arg if arg is not None else data,
                              capture_output=True, check=True)

    try:
        for _ in range(600):
            if subprocess.run(['redis-cli', '-p', port, 'ping'], capture_output=True).stdout.strip() == b'PONG':
                break
            time.sleep(0.1)
        else:
            sys.exit('redis-server under callgrind did not start')
        cli('hset', 'lb:epoch', 'id', 'E1', 'layout', '2')
        if opts.functions:
            load_library(cli)
        dumps = [0]

        def count(name, commands):
            subprocess.run(['callgrind_control', '-z', str(server.pid)], capture_output=True)
            out = cli('--pipe', data=resp(commands)).stdout
            if b'errors: 0' not in out:
                sys.exit(f'{name}: {out.decode()}')
            subprocess.run(['callgrind_control', '-d', str(server.pid)], capture_output=True)
            dumps[0] += 1
            for _ in range(100):
                files = glob.glob(f'{work}/cg.out.*')
                if len(files) >= dumps[0]:
                    break
                time.sleep(0.05)
            latest = max(files, key=os.path.getmtime)
            time.sleep(0.2)
            text = subprocess.run(['callgrind_annotate', latest], capture_output=True, text=True).stdout
            total = int(re.search(r'([\d,]+) \(100\.0%\)\s+PROGRAM TOTALS', text).group(1).replace(',', ''))
            return total / len(commands)

        if opts.contended:
            contended(opts, cli, count)
            return
        if opts.batch:
            batched(opts, cli, count)
            return
        n = opts.calls
        # The minimal proxy's release (the bench's own script).
        cas = source(None, 'bench/src/compare_and_delete.lua')
        rows = []
        for rev in revisions(opts):
            claim, release = load(cli, rev, 'claim'), load(cli, rev, 'release')
            tag = random.randrange(10 ** 9)

            def keys(i):
                return key_names(f'lb:{{k{tag}-{i}}}')
            before = int(cli('dbsize').stdout)
            if 'context_of' in script(rev, 'claim'):
                # One context string for what only the slow paths read (scripts/grant.rs).
                def claim_args(i):
                    return [f'tok{i}', 30000, '', 'E1', '', 'broker1', f'0|x|500|L|5|0|lb:b:k{i}']

                def release_args(i):
                    return [f'tok{i}', 'E1', 'broker1', f'0|x|500|L|5|11|lb:b:lb:releasedk{i}']
            else:
                def claim_args(i):
                    return [f'tok{i}', 30000, '', 60000, 'E1', '', 0, 'x', 'broker1', 'lb:b:', 500,
                            f'k{i}', 'L']

                def release_args(i):
                    return [f'tok{i}', 'E1', 'broker1', 'lb:b:', 500, f'k{i}', 'L', 60000,
                            'lb:released']
            c = count('claim', [[*claim, 8, *keys(i), *claim_args(i)] for i in range(n)])
            r = count('release', [[*release, 8, *keys(i), *release_args(i)] for i in range(n)])
            left = int(cli('dbsize').stdout) - before
            rows.append((rev or 'working tree', c, r, left))
        proxy = cli('script', 'load', cas).stdout.decode().strip()
        tag = random.randrange(10 ** 9)
        ps = count('set', [['SET', f'p{tag}-{i}', f'tok{i}', 'NX', 'PX', 30000] for i in range(n)])
        pr = count('del', [['EVALSHA', proxy, 1, f'p{tag}-{i}', f'tok{i}'] for i in range(n)])
        print(f'Redis instructions per call (callgrind, {n} calls per step, new key each)')
        print(f'{"scripts":<22}{"acquire":>10}{"release":>10}{"cycle":>10}{"/ proxy":>9}{"keys left":>11}')
        for name, c, r, left in rows:
            print(f'{name:<22}{c:>10.0f}{r:>10.0f}{c + r:>10.0f}{(c + r) / (ps + pr):>9.2f}{left / n:>11.3f}')
        print(f'{"proxy":<22}{ps:>10.0f}{pr:>10.0f}{ps + pr:>10.0f}{1:>9.2f}{0:>11.3f}')
    finally:
        subprocess.run(['redis-cli', '-p', port, 'shutdown', 'nosave'], capture_output=True)
        server.wait(timeout=60)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == '__main__':
    main()
