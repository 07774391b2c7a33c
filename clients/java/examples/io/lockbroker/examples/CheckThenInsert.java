package io.lockbroker.examples;

import io.lockbroker.client.Lease;
import io.lockbroker.client.LockBroker;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;

/**
 * The check-then-insert handler of the story lockbroker comes from (nginx in front of many
 * Tomcats; "count the rows for this business; if there are none, insert one"), guarded by the
 * client instead of a hand-written SETNX/GETSET lock. Without the lock, concurrent requests on
 * different nodes all see zero rows and each inserts one.
 *
 * <p>Run it against a broker: {@code java -cp target/lockbroker-client.jar:target/examples
 * io.lockbroker.examples.CheckThenInsert http://127.0.0.1:8080 [requests]}. It sends the requests
 * from 32 threads through two clients (two "nodes") and prints how many rows were left: 1.
 */
public final class CheckThenInsert {
    /**
     * A stand-in for the {@code business_log} table. Like a real resource that takes the fence,
     * it refuses a write whose fence is lower than one it has already seen: a writer that lost
     * its lease (a long GC pause, a partition) cannot overwrite its successor's work.
     */
    public static final class BusinessLogTable {
        private final List<String> rows = new ArrayList<>();
        private long highestFence;

        public synchronized int count(String businessName) {
            return (int) rows.stream().filter(businessName::equals).count();
        }

        public synchronized void insert(String businessName, long fence) {
            if (fence < highestFence) {
                throw new IllegalStateException("stale writer: fence " + fence + " < " + highestFence);
            }
            highestFence = fence;
            rows.add(businessName);
        }
    }

    private final LockBroker broker;
    private final BusinessLogTable table;

    public CheckThenInsert(LockBroker broker, BusinessLogTable table) {
        this.broker = broker;
        this.table = table;
    }

    /**
     * The handler: inserts the row unless it exists. True when this call inserted it.
     * The lease is held across the check and the insert, renewed while they run, and released
     * on the way out whatever happens.
     */
    public boolean saveOnce(String businessName) {
        String key = "business-log:" + businessName;
        try (Lease lease = broker.acquire(key, Duration.ofSeconds(10), Duration.ofSeconds(30))) {
            if (table.count(businessName) >= 1) {
                return false;
            }
            // Stop writing if the lease was lost meanwhile; the fence guards what is in flight.
            lease.ensureHeld();
            table.insert(businessName, lease.fence());
            return true;
        }
    }

    public static void main(String[] args) throws Exception {
        String url = args.length > 0 ? args[0] : "http://127.0.0.1:8080";
        int requests = args.length > 1 ? Integer.parseInt(args[1]) : 1000;
        BusinessLogTable table = new BusinessLogTable();
        ExecutorService pool = Executors.newFixedThreadPool(32);
        try (LockBroker node1 = LockBroker.create(url); LockBroker node2 = LockBroker.create(url)) {
            CheckThenInsert[] nodes = {new CheckThenInsert(node1, table), new CheckThenInsert(node2, table)};
            List<Future<Boolean>> results = new ArrayList<>();
            String name = "disable-distributed-save-" + System.currentTimeMillis();
            for (int i = 0; i < requests; i++) {
                CheckThenInsert node = nodes[i % 2];
                results.add(pool.submit(() -> node.saveOnce(name)));
            }
            int inserted = 0;
            for (Future<Boolean> result : results) {
                inserted += result.get() ? 1 : 0;
            }
            System.out.println(requests + " requests, " + inserted + " inserted, rows: " + table.count(name));
            if (table.count(name) != 1) {
                System.exit(1);
            }
        } finally {
            pool.shutdown();
        }
    }
}
