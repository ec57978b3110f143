import com.sun.tools.attach.VirtualMachine;
import java.util.Set;
import javax.management.MBeanAttributeInfo;
import javax.management.MBeanServerConnection;
import javax.management.ObjectName;
import javax.management.remote.JMXConnector;
import javax.management.remote.JMXConnectorFactory;
import javax.management.remote.JMXServiceURL;

/**
 * Attaches to a local JVM (pid, same user) through its local management agent and prints every
 * numeric attribute of the MBeans matching the patterns, one "name TAB attribute TAB value" a line.
 * Used by bench/fanout/broker_probe.py to read the broker's own metrics (fetch sessions,
 * connections, requests by type) without opening a JMX port on it.
 */
public class JmxProbe {
    public static void main(String[] args) throws Exception {
        VirtualMachine vm = VirtualMachine.attach(args[0]);
        String address;
        try {
            address = vm.startLocalManagementAgent();
        } finally {
            vm.detach();
        }
        try (JMXConnector c = JMXConnectorFactory.connect(new JMXServiceURL(address))) {
            MBeanServerConnection s = c.getMBeanServerConnection();
            for (int i = 1; i < args.length; i++) {
                Set<ObjectName> names = s.queryNames(new ObjectName(args[i]), null);
                for (ObjectName n : names) {
                    for (MBeanAttributeInfo a : s.getMBeanInfo(n).getAttributes()) {
                        Object v;
                        try { v = s.getAttribute(n, a.getName()); } catch (Exception e) { continue; }
                        if (v instanceof Number) {
                            System.out.println(n + "\t" + a.getName() + "\t" + v);
                        }
                    }
                }
            }
        }
    }
}
